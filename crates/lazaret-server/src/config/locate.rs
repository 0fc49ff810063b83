//! Where a config error is: the file, the 1-based line and the key as a
//! dotted path (`types.send_email.attempts_max`, `tokens[1].role`), found
//! from the spans of the parsed TOML tree.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// A config that cannot be used, and where and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file itself could not be read.
    #[error("cannot read config file {}: {source}; check the path given to --config", path.display())]
    Read {
        /// The file, as given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key or value is wrong (or the TOML is), located as precisely as possible.
    #[error("{}", render_invalid(.file.as_deref(), *.line, .key.as_deref(), .message))]
    Invalid {
        /// The config file, when loaded from one.
        file: Option<PathBuf>,
        /// 1-based line of the key (or of the nearest enclosing table that is written out).
        line: Option<usize>,
        /// The key as a dotted path, `types.send_email.attempts_max`, `tokens[0].role`.
        key: Option<String>,
        /// What is wrong and what to do about it.
        message: String,
    },
}

impl ConfigError {
    /// The dotted key the error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => key.as_deref(),
            ConfigError::Read { .. } => None,
        }
    }

    /// The 1-based line the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            ConfigError::Invalid { line, .. } => *line,
            ConfigError::Read { .. } => None,
        }
    }
}

fn render_invalid(
    file: Option<&Path>,
    line: Option<usize>,
    key: Option<&str>,
    message: &str,
) -> String {
    // `file:line: key: message`, the shape editors and terminals link to.
    let mut out = String::new();
    match (file, line) {
        (Some(f), Some(l)) => out.push_str(&format!("{}:{l}: ", f.display())),
        (Some(f), None) => out.push_str(&format!("{}: ", f.display())),
        (None, Some(l)) => out.push_str(&format!("config line {l}: ")),
        (None, None) => out.push_str("config: "),
    }
    if let Some(k) = key {
        out.push_str(k);
        out.push_str(": ");
    }
    out.push_str(message);
    out
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// A dotted key path, as TOML would write it: `types.send_email.kinds.parse`, `tokens[1].role`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct KeyPath(Vec<Seg>);

impl KeyPath {
    pub(super) fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_owned()));
        p
    }

    pub(super) fn index(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

pub(super) fn root(k: &str) -> KeyPath {
    KeyPath::default().key(k)
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// The text, its spanned tree and where it came from: what every error needs.
pub(super) struct Ctx<'a> {
    text: &'a str,
    pub(super) tree: Spanned<DeTable<'a>>,
    file: Option<&'a Path>,
}

enum Node<'t, 'a> {
    Table(&'t DeTable<'a>),
    Array(&'t [Spanned<DeValue<'a>>]),
    Leaf,
}

fn node<'t, 'a>(v: &'t DeValue<'a>) -> Node<'t, 'a> {
    match v {
        DeValue::Table(t) => Node::Table(t),
        DeValue::Array(a) => Node::Array(a),
        _ => Node::Leaf,
    }
}

impl<'a> Ctx<'a> {
    pub(super) fn parse(text: &'a str, file: Option<&'a Path>) -> Result<Self, ConfigError> {
        let tree = DeTable::parse(text).map_err(|e| {
            let line = e.span().map(|s| line_at(text, s.start));
            ConfigError::Invalid {
                file: file.map(Path::to_owned),
                line,
                key: None,
                message: format!(
                    "this is not valid TOML: {}; fix the syntax on this line",
                    e.message()
                ),
            }
        })?;
        Ok(Ctx { text, tree, file })
    }

    pub(super) fn error(
        &self,
        line: Option<usize>,
        key: Option<String>,
        message: String,
    ) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.map(Path::to_owned),
            line,
            key,
            message,
        }
    }

    /// An error about `path`, on the line of its key, or of the nearest
    /// enclosing key written in the file when `path` itself is inherited.
    pub(super) fn invalid(&self, path: &KeyPath, message: impl Into<String>) -> ConfigError {
        self.error(self.line_of(path), Some(path.to_string()), message.into())
    }

    pub(super) fn line_of(&self, path: &KeyPath) -> Option<usize> {
        let mut at = Node::Table(self.tree.get_ref());
        let mut best: Option<Range<usize>> = None;
        for seg in &path.0 {
            let next = match (seg, at) {
                (Seg::Key(k), Node::Table(t)) => t
                    .get_key_value(k.as_str())
                    .map(|(key, v)| (key.span(), v.get_ref())),
                (Seg::Index(i), Node::Array(a)) => a.get(*i).map(|v| (v.span(), v.get_ref())),
                _ => None,
            };
            let Some((span, v)) = next else { break };
            best = Some(span);
            at = node(v);
        }
        best.map(|s| line_at(self.text, s.start))
    }

    /// The key path whose key or value most tightly encloses byte `offset`.
    fn path_at(&self, offset: usize) -> Option<KeyPath> {
        fn consider(
            span: Range<usize>,
            p: &KeyPath,
            offset: usize,
            best: &mut Option<(usize, KeyPath)>,
        ) {
            let inside = span.contains(&offset) || (span.is_empty() && span.start == offset);
            // `<=`: on a tie the later, deeper candidate wins.
            if inside && best.as_ref().is_none_or(|(l, _)| span.len() <= *l) {
                *best = Some((span.len(), p.clone()));
            }
        }
        fn walk(
            at: Node<'_, '_>,
            path: &KeyPath,
            offset: usize,
            best: &mut Option<(usize, KeyPath)>,
        ) {
            match at {
                Node::Table(t) => {
                    for (k, v) in t.iter() {
                        let p = path.key(k.get_ref());
                        consider(k.span(), &p, offset, best);
                        consider(v.span(), &p, offset, best);
                        walk(node(v.get_ref()), &p, offset, best);
                    }
                }
                Node::Array(a) => {
                    for (i, v) in a.iter().enumerate() {
                        let p = path.index(i);
                        consider(v.span(), &p, offset, best);
                        walk(node(v.get_ref()), &p, offset, best);
                    }
                }
                Node::Leaf => {}
            }
        }
        let mut best = None;
        walk(
            Node::Table(self.tree.get_ref()),
            &KeyPath::default(),
            offset,
            &mut best,
        );
        best.map(|(_, p)| p)
    }

    pub(super) fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let Some(span) = e.span() else {
            return self.error(None, None, e.message().to_owned());
        };
        let msg = e.message();
        let hint = if msg.starts_with("unknown field") {
            "remove the key or fix its spelling"
        } else if msg.starts_with("invalid type") || msg.starts_with("invalid value") {
            "change the value to what is expected"
        } else if msg.starts_with("unknown variant") {
            "use one of the values listed"
        } else {
            ""
        };
        let message = if hint.is_empty() {
            msg.to_owned()
        } else {
            format!("{msg}; {hint}")
        };
        let key = self.path_at(span.start).map(|p| p.to_string());
        self.error(Some(line_at(self.text, span.start)), key, message)
    }

    pub(super) fn on_line(&self, path: &KeyPath) -> String {
        self.line_of(path)
            .map_or_else(String::new, |l| format!(" (line {l})"))
    }
}

/// 1-based line of byte `offset` in `text`.
fn line_at(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}
