//! `[[tokens]]`: who may call the API, and as what.

use serde::Deserialize;

use super::{ConfigError, Ctx, RawConfig, root};
use crate::auth::{Role, TokenConfig, token_sha256};

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a token table with name, role and token or token_sha256"
)]
pub(super) struct RawToken {
    name: Option<String>,
    role: Option<String>,
    token: Option<String>,
    token_sha256: Option<String>,
}

impl Ctx<'_> {
    pub(super) fn tokens(&self, raw: &RawConfig) -> Result<Vec<TokenConfig>, ConfigError> {
        let mut out: Vec<TokenConfig> = Vec::with_capacity(raw.tokens.len());
        for (i, t) in raw.tokens.iter().enumerate() {
            let path = root("tokens").index(i);
            let name = t.name.as_deref().unwrap_or("");
            if name.trim().is_empty() {
                return Err(self.invalid(
                    &path.key("name"),
                    "every token needs a name (it is the actor in the audit log): add name = \"...\"",
                ));
            }
            if name == "." || name == ".." {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "token name {name:?} is not allowed: it is a path segment of its own in \
                         /v1/tokens/{{name}}; use letters or digits as well"
                    ),
                ));
            }
            if let Err(e) =
                lazaret_core::check_name("name", name, crate::auth::TOKEN_NAME_BYTES_MAX)
            {
                return Err(self.invalid(
                    &path.key("name"),
                    format!("{e}; the name is the actor in the audit log"),
                ));
            }
            let role = match t.role.as_deref() {
                None => {
                    return Err(self.invalid(
                        &path.key("role"),
                        "every token needs a role: add role = \"producer\", \"worker\", \"operator\" or \"admin\"",
                    ));
                }
                Some(r) => r
                    .parse::<Role>()
                    .map_err(|e| self.invalid(&path.key("role"), e.to_string()))?,
            };
            let (secret_key, sha256) = match (&t.token, &t.token_sha256) {
                (Some(_), Some(_)) => {
                    return Err(self.invalid(
                        &path.key("token_sha256"),
                        "set either token or token_sha256, not both: keep token_sha256 to keep the secret out of the file",
                    ));
                }
                (None, None) => {
                    return Err(self.invalid(
                        &path,
                        "a token needs its secret: add token = \"...\" or token_sha256 = \"<64 hex digits>\"",
                    ));
                }
                (Some(token), None) => {
                    if token.trim().is_empty() {
                        return Err(self.invalid(
                            &path.key("token"),
                            "the token is empty or only whitespace (a client cannot send it: \
                             the Authorization header's value is trimmed); give a long random secret",
                        ));
                    }
                    ("token", token_sha256(token))
                }
                (None, Some(h)) => {
                    let mut sha = [0u8; 32];
                    hex::decode_to_slice(h.trim(), &mut sha).map_err(|_| {
                        self.invalid(
                            &path.key("token_sha256"),
                            "token_sha256 must be 64 hex digits, the SHA-256 of the token (printf %s \"$TOKEN\" | sha256sum)",
                        )
                    })?;
                    ("token_sha256", sha)
                }
            };
            if let Some(j) = out.iter().position(|o| o.name == name) {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "token name `{name}` is already used by tokens[{j}]{}; names identify the actor in the audit log, so rename one",
                        self.on_line(&root("tokens").index(j).key("name"))
                    ),
                ));
            }
            if let Some(other) = out.iter().find(|o| o.sha256 == sha256) {
                return Err(self.invalid(
                    &path.key(secret_key),
                    format!(
                        "this token's secret is also the secret of token `{}`; give each token its own, or the audit log cannot tell who acted",
                        other.name
                    ),
                ));
            }
            out.push(TokenConfig {
                name: name.to_owned(),
                role,
                sha256,
            });
        }
        Ok(out)
    }
}
