//! API-created tokens: list, create, revoke.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use lazaret_store::{ApiToken, AuditEntry, Store, TokenError};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::{Caller, check_token_name, new_secret};
use crate::auth::{Role, TokenConfig, token_sha256};
use crate::error::ApiError;
use crate::views;

use super::{ApiResult, Shared, ok, parse_json};

/// Token endpoints need auth on: with no `[[tokens]]` every caller is an
/// anonymous admin, and a token created then would lock nobody out and
/// protect nothing.
fn tokens_need_auth<S: Store>(app: &App<S>) -> Result<(), ApiError> {
    if app.auth_on() {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "auth is off (no [[tokens]] in the config file), so there are no tokens to manage: \
         configure at least one admin token in [[tokens]] and restart the server first",
    ))
}

pub(super) async fn tokens<S: Store>(State(app): Shared<S>) -> ApiResult {
    tokens_need_auth(&app)?;
    let stored = app.store.tokens().await?;
    let items: Vec<Value> = app
        .config
        .tokens
        .iter()
        .map(views::config_token)
        .chain(stored.iter().map(views::api_token))
        .collect();
    ok(json!({ "items": items }))
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct CreateTokenBody {
    name: Option<String>,
    role: Option<String>,
}

pub(super) async fn create_token<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    tokens_need_auth(&app)?;
    let b: CreateTokenBody = parse_json(&body)?;
    let name = b.name.unwrap_or_default();
    check_token_name(&name).map_err(ApiError::bad_request)?;
    let role: Role = b
        .role
        .as_deref()
        .ok_or_else(|| {
            ApiError::bad_request(
                "role is required: send \"role\": \"producer\", \"worker\", \"operator\" or \"admin\"",
            )
        })?
        .parse()
        .map_err(|e: crate::auth::UnknownRole| ApiError::bad_request(e.to_string()))?;
    if app.config.tokens.iter().any(|t| t.name == name) {
        return Err(ApiError::conflict(format!(
            "token name {name:?} is used by a token in the config file ([[tokens]]); \
             names identify the actor in the audit log, so pick another"
        )));
    }
    let secret = new_secret().map_err(|e| {
        ApiError::internal(format!(
            "the operating system's random generator failed ({e}); retry"
        ))
    })?;
    let sha256 = token_sha256(&secret);
    let now = now();
    let stored = ApiToken {
        name: name.clone(),
        role: role.as_str().to_owned(),
        token_sha256: hex::encode(sha256),
        created_at: now,
        created_by: caller.name.clone(),
    };
    // The audit entry records what was asked, never the secret.
    let entry = AuditEntry {
        at: now,
        actor: caller.name,
        action: "token_create".into(),
        request: json!({ "name": name, "role": role.as_str() }),
        count: 1,
    };
    let changing = app.token_changes.lock().await;
    match app.store.create_token(stored, entry).await? {
        Ok(()) => {}
        Err(TokenError::NameTaken) => {
            return Err(ApiError::conflict(format!(
                "a token named {name:?} exists already (created through the API); \
                 pick another name, or revoke it first with DELETE /v1/tokens/{name}"
            )));
        }
        Err(e) => {
            return Err(ApiError::internal(format!(
                "the new token was not stored: {e}"
            )));
        }
    }
    // In force before the 201 leaves: the caller may use it at once.
    app.api_tokens
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(TokenConfig {
            name: name.clone(),
            role,
            sha256,
        });
    drop(changing);
    tracing::info!(token = %name, role = %role, "token created");
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "name": name,
            "role": role.as_str(),
            "token": secret,
            "created_at": views::time(now),
        })),
    )
        .into_response())
}

pub(super) async fn revoke_token<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    tokens_need_auth(&app)?;
    if app.config.tokens.iter().any(|t| t.name == name) {
        return Err(ApiError::bad_request(format!(
            "token {name:?} comes from the config file ([[tokens]]): remove it there and restart \
             the server to revoke it"
        )));
    }
    let entry = AuditEntry {
        at: now(),
        actor: caller.name,
        action: "token_revoke".into(),
        request: json!({ "name": name }),
        count: 1,
    };
    let changing = app.token_changes.lock().await;
    if !app.store.revoke_token(name.clone(), entry).await? {
        return Err(ApiError::not_found(format!(
            "no token named {name:?} was created through the API; GET /v1/tokens lists them"
        )));
    }
    app.api_tokens
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&name);
    drop(changing);
    tracing::info!(token = %name, "token revoked");
    ok(json!({ "name": name, "revoked": true }))
}
