//! Admission: the gate at the door, where poison is stopped before it is stored.
//!
//! [`admit`] takes an [`AdmissionConfig`] and one [`AdmissionRequest`] and
//! returns a [`Verdict`]. It reads no file and no clock: schemas arrive
//! compiled in [`TypeSchemas`] (the server reads the schema files and hands
//! over `serde_json::Value`s), and whether a type is shedding load (breaker
//! open, type or lane paused) is an input, [`AdmissionRequest::shed`].
//!
//! # Order of checks
//!
//! Cheapest first, so a 50 MB blob costs one comparison and never a parse:
//!
//! 1. **byte cap** — the payload's length, or its announced size, over
//!    `payload_bytes_max` → [`Verdict::Poison`] `payload_too_large`. The server
//!    may run this step alone with [`check_size`] while it streams, and the
//!    whole-body cap with [`check_body_size`].
//! 2. **job type** present and not blank → else [`Verdict::BadRequest`].
//! 3. **tenant** present and not blank → else [`Verdict::NoTenant`].
//! 4. **type known** → else [`Verdict::UnknownType`], only when
//!    `accept_unknown_types` is false.
//! 5. **shed** — the caller says the type is not taking work now →
//!    [`Verdict::Shed`] with its `Retry-After`.
//! 6. **JSON** — UTF-8 and JSON syntax → else `invalid_json`.
//! 7. **schema version** among the type's versions → else
//!    `unknown_schema_version`. A type without schemas takes any version as is.
//! 8. **schema** — the payload validates against that version → else
//!    `schema_invalid`, with at most [`VIOLATIONS_MAX`] [`Violation`]s.
//!
//! Validation is tolerant: a field the schema does not mention passes, unless
//! the schema itself says `additionalProperties: false`. Nothing here adds
//! strictness a schema's author did not write.
//!
//! Every message says what was wrong and what the producer should do, because
//! the producer is the only one who can fix it.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::failure::{PoisonReason, truncate_head};
use crate::ids::JobType;
use crate::time::duration_ms;

/// Default cap on a payload's bytes (`payload_bytes_max`): 256 KiB.
pub const PAYLOAD_BYTES_MAX_DEFAULT: usize = 256 * 1024;
/// What a request body may carry beyond its payload (type, tenant, keys…).
pub const ENVELOPE_BYTES_MAX: usize = 16 * 1024;
/// Most schema violations reported in one verdict's `details`.
pub const VIOLATIONS_MAX: usize = 20;
/// Longest message kept for one violation, in bytes, before a truncation
/// marker (a message may quote the payload's property names).
pub const VIOLATION_MESSAGE_BYTES_MAX: usize = 512;
/// Longest instance path kept for one violation, in bytes, before a truncation marker.
pub const VIOLATION_PATH_BYTES_MAX: usize = 1024;
/// Longest payload preview, in bytes: the one size of every preview
/// lazaret keeps or shows (a dead letter's `payload_preview`, a job's
/// `?payload=preview`, the head kept of a body refused as too large). The
/// dashboard reads it from `GET /v1/whoami` rather than knowing it.
pub const PREVIEW_BYTES_MAX: usize = 4 * 1024;

/// Longest producer-supplied name echoed back in a message, in bytes.
const ECHO_BYTES_MAX: usize = 128;
/// Longest reason kept in a [`SchemaError`], in bytes.
const SCHEMA_REASON_BYTES_MAX: usize = 1024;
/// Most known types listed in an `UNKNOWN_TYPE` message.
const LISTED_TYPES_MAX: usize = 20;

/// A schema that does not compile: the server should refuse to start with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error(
    "schema version {version} of type {job_type} is not a usable JSON Schema: {reason}; fix the file given as schemas = {{ {version} = \"...\" }} under [types.{job_type}]"
)]
pub struct SchemaError {
    /// The type whose schema is broken.
    pub job_type: JobType,
    /// The broken version.
    pub version: u32,
    /// What is wrong, with the location inside the schema when there is one.
    pub reason: String,
}

/// The compiled schemas of one job type, one per schema version.
///
/// A type with no schemas (`TypeSchemas::default()`) is still a known type;
/// its payload need only be valid JSON.
#[derive(Clone, Default)]
pub struct TypeSchemas {
    validators: BTreeMap<u32, jsonschema::Validator>,
}

impl fmt::Debug for TypeSchemas {
    // A compiled validator's tree says nothing useful in a log; the versions do.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypeSchemas")
            .field("versions", &self.validators.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl TypeSchemas {
    /// Compiles every version's schema for type `ty`.
    ///
    /// The draft is taken from each schema's `$schema` (2020-12 when absent).
    /// External `$ref`s are never fetched — the core does no I/O, whatever
    /// features other crates turn on in `jsonschema` — so a schema must be
    /// self-contained.
    ///
    /// # Errors
    ///
    /// [`SchemaError`] naming the type and the first version that does not
    /// compile.
    pub fn compile(ty: &JobType, versions: BTreeMap<u32, Value>) -> Result<Self, SchemaError> {
        let options = jsonschema::options().offline();
        let mut validators = BTreeMap::new();
        for (version, schema) in versions {
            let validator = options.build(&schema).map_err(|e| {
                let mut reason = e.to_string();
                let at = e.instance_path().as_str();
                if !at.is_empty() {
                    reason = format!("at {at}: {reason}");
                }
                truncate_head(&mut reason, SCHEMA_REASON_BYTES_MAX);
                SchemaError {
                    job_type: ty.clone(),
                    version,
                    reason,
                }
            })?;
            validators.insert(version, validator);
        }
        Ok(TypeSchemas { validators })
    }

    /// The latest version: the highest one. `None` when there are no schemas.
    pub fn latest(&self) -> Option<u32> {
        self.validators.keys().next_back().copied()
    }

    /// The known versions, lowest first.
    pub fn versions(&self) -> impl Iterator<Item = u32> + '_ {
        self.validators.keys().copied()
    }

    /// Whether `version` is one of the known versions.
    pub fn contains(&self, version: u32) -> bool {
        self.validators.contains_key(&version)
    }

    /// Whether the type has no schemas at all (any JSON is accepted).
    pub fn is_empty(&self) -> bool {
        self.validators.is_empty()
    }

    /// Checks `instance` against `version`'s schema: every violation, in the
    /// validator's order, at most [`VIOLATIONS_MAX`] of them, and the total
    /// count. An unknown version or a type without schemas has no violations.
    pub fn violations(&self, version: u32, instance: &Value) -> (Vec<Violation>, usize) {
        let Some(validator) = self.validators.get(&version) else {
            return (Vec::new(), 0);
        };
        let mut details = Vec::new();
        let mut total = 0;
        for error in validator.iter_errors(instance) {
            total += 1;
            if details.len() < VIOLATIONS_MAX {
                details.push(Violation::from_error(&error));
            }
        }
        (details, total)
    }
}

/// What admission needs to know, read from the server's config.
#[derive(Clone, Debug)]
pub struct AdmissionConfig {
    /// Cap on a payload's bytes (`payload_bytes_max`).
    pub payload_bytes_max: usize,
    /// Whether a type not listed in `types` is admitted (`accept_unknown_types`).
    pub accept_unknown_types: bool,
    /// The configured types (`[types.X]`) and their schemas; a type may be
    /// listed with no schemas.
    pub types: BTreeMap<JobType, TypeSchemas>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            payload_bytes_max: PAYLOAD_BYTES_MAX_DEFAULT,
            accept_unknown_types: true,
            types: BTreeMap::new(),
        }
    }
}

impl AdmissionConfig {
    /// Cap on a whole request body: the payload cap plus [`ENVELOPE_BYTES_MAX`].
    pub fn body_bytes_max(&self) -> usize {
        self.payload_bytes_max.saturating_add(ENVELOPE_BYTES_MAX)
    }
}

/// One job as it arrives, before anything is stored.
#[derive(Clone, Copy, Debug, Default)]
pub struct AdmissionRequest<'a> {
    /// The job's `type`, as sent.
    pub job_type: Option<&'a str>,
    /// The job's `tenant`, as sent.
    pub tenant: Option<&'a str>,
    /// The requested `schema_version`; `None` means the latest.
    pub schema_version: Option<u32>,
    /// The raw JSON text of the `payload` value, byte for byte.
    pub payload: &'a [u8],
    /// The payload's size as announced before it was read (a length header),
    /// if any; checked against the cap even when `payload` is shorter.
    pub declared_size: Option<u64>,
    /// `Some(retry_after)` when the type's breaker is open or the type or its
    /// lane is paused; the caller knows, the core does not keep that state here.
    pub shed: Option<Duration>,
}

/// One way a payload breaks its schema.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// JSON pointer of the offending value in the payload (`""` is the whole
    /// payload; a missing required field is reported at its parent object).
    pub path: String,
    /// What is wrong there. Payload values are masked as `value`; property
    /// names may be quoted.
    pub message: String,
}

impl Violation {
    fn from_error(error: &jsonschema::ValidationError<'_>) -> Self {
        let mut path = error.instance_path().as_str().to_owned();
        truncate_head(&mut path, VIOLATION_PATH_BYTES_MAX);
        // Masked: a message must not echo a 200 KiB string back, nor leak it.
        let mut message = error.masked().to_string();
        truncate_head(&mut message, VIOLATION_MESSAGE_BYTES_MAX);
        Violation { path, message }
    }
}

/// The decision about one job at the door.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Store it.
    Admitted {
        /// The version the payload was checked against: the requested one or
        /// the type's latest; for a type without schemas (or an unknown type),
        /// the requested one as is, or `None`.
        schema_version: Option<u32>,
    },
    /// `POISON`: never stored as a job, never leased; kept as an admission record.
    Poison {
        /// Why.
        reason: PoisonReason,
        /// What was wrong and what to do.
        message: String,
        /// Schema violations (`schema_invalid` only), at most [`VIOLATIONS_MAX`].
        details: Vec<Violation>,
    },
    /// `NO_TENANT`: the tenant is missing or blank.
    NoTenant {
        /// What was wrong and what to do.
        message: String,
    },
    /// `UNKNOWN_TYPE`: the type is not configured and only known types are accepted.
    UnknownType {
        /// What was wrong and what to do.
        message: String,
    },
    /// `SHED`: the type is not taking work now; try again after `retry_after`.
    Shed {
        /// How long to wait (`Retry-After`).
        retry_after: Duration,
        /// What was wrong and what to do.
        message: String,
    },
    /// `BAD_REQUEST`: malformed in some other way (no job type).
    BadRequest {
        /// What was wrong and what to do.
        message: String,
    },
}

impl Verdict {
    /// Whether the job is to be stored.
    pub fn is_admitted(&self) -> bool {
        matches!(self, Verdict::Admitted { .. })
    }

    /// The word used in the API: `ADMITTED` or the error `code`.
    pub const fn code(&self) -> &'static str {
        match self {
            Verdict::Admitted { .. } => "ADMITTED",
            Verdict::Poison { .. } => "POISON",
            Verdict::NoTenant { .. } => "NO_TENANT",
            Verdict::UnknownType { .. } => "UNKNOWN_TYPE",
            Verdict::Shed { .. } => "SHED",
            Verdict::BadRequest { .. } => "BAD_REQUEST",
        }
    }

    /// The poison reason, for `POISON` verdicts.
    pub const fn poison_reason(&self) -> Option<PoisonReason> {
        match self {
            Verdict::Poison { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// The message of a refusal; `None` when admitted.
    pub fn message(&self) -> Option<&str> {
        match self {
            Verdict::Admitted { .. } => None,
            Verdict::Poison { message, .. }
            | Verdict::NoTenant { message }
            | Verdict::UnknownType { message }
            | Verdict::Shed { message, .. }
            | Verdict::BadRequest { message } => Some(message),
        }
    }

    fn poison(reason: PoisonReason, message: String) -> Self {
        Verdict::Poison {
            reason,
            message,
            details: Vec::new(),
        }
    }
}

/// The byte-cap step alone: `Some(POISON payload_too_large)` when a payload
/// of `size` bytes is over `payload_bytes_max`. For a server that learns the
/// size (a length header, bytes read so far) before it has the whole payload.
pub fn check_size(config: &AdmissionConfig, size: u64) -> Option<Verdict> {
    let cap = config.payload_bytes_max;
    (size > to_u64(cap)).then(|| {
        Verdict::poison(
            PoisonReason::PayloadTooLarge,
            format!(
                "payload is {size} bytes; the cap is {cap} bytes (payload_bytes_max). \
                 Store large blobs elsewhere and enqueue a reference."
            ),
        )
    })
}

/// The whole-body cap: `Some(POISON payload_too_large)` when a request body
/// of `size` bytes is over [`AdmissionConfig::body_bytes_max`], so the server
/// can refuse it before reading it whole.
pub fn check_body_size(config: &AdmissionConfig, size: u64) -> Option<Verdict> {
    let max = config.body_bytes_max();
    (size > to_u64(max)).then(|| {
        Verdict::poison(
            PoisonReason::PayloadTooLarge,
            format!(
                "request body is {size} bytes; at most {max} bytes are read \
                 (payload_bytes_max = {} plus {ENVELOPE_BYTES_MAX} for the rest of the job). \
                 Store large blobs elsewhere and enqueue a reference.",
                config.payload_bytes_max
            ),
        )
    })
}

/// Decides one job, in the order documented on this module.
pub fn admit(config: &AdmissionConfig, req: &AdmissionRequest<'_>) -> Verdict {
    // 1. Byte cap: the larger of what arrived and what was announced.
    let size = to_u64(req.payload.len()).max(req.declared_size.unwrap_or(0));
    if let Some(verdict) = check_size(config, size) {
        return verdict;
    }

    // 2. Job type.
    let job_type = match req.job_type {
        Some(t) if !t.trim().is_empty() => t,
        _ => {
            return Verdict::BadRequest {
                message: "job type is missing or empty; set \"type\" on every job \
                          (for example \"send_email\")"
                    .to_owned(),
            };
        }
    };

    // 3. Tenant.
    if req.tenant.is_none_or(|t| t.trim().is_empty()) {
        return Verdict::NoTenant {
            message: "tenant is missing or empty; set \"tenant\" on every job".to_owned(),
        };
    }

    // 4. Known type. An unknown type that is accepted behaves as a type
    //    without schemas.
    let schemas = config.types.get(job_type);
    if schemas.is_none() && !config.accept_unknown_types {
        return Verdict::UnknownType {
            message: unknown_type_message(config, job_type),
        };
    }

    // 5. Shed.
    if let Some(retry_after) = req.shed {
        let ms = duration_ms(retry_after);
        return Verdict::Shed {
            retry_after,
            message: format!(
                "type {} is not taking jobs now (its breaker is open or the type or lane \
                 is paused); retry after {ms} ms (Retry-After) rather than at once",
                echo(job_type)
            ),
        };
    }

    // 6. JSON.
    let payload = match parse_json(req.payload) {
        Ok(v) => v,
        Err(why) => {
            return Verdict::poison(
                PoisonReason::InvalidJson,
                format!(
                    "payload is not valid JSON: {why}. Send the payload as one UTF-8 JSON \
                     value (object, array, string, number, true, false or null)."
                ),
            );
        }
    };

    // 7. Schema version.
    let Some((schemas, latest)) = schemas.and_then(|s| Some((s, s.latest()?))) else {
        return Verdict::Admitted {
            schema_version: req.schema_version,
        };
    };
    let version = match req.schema_version {
        None => latest,
        Some(v) if schemas.contains(v) => v,
        Some(v) => {
            let known = join(schemas.versions());
            return Verdict::poison(
                PoisonReason::UnknownSchemaVersion,
                format!(
                    "schema version {v} is unknown for type {job_type}; known versions: {known}. \
                     Send one of them, or omit schema_version for the latest ({latest})."
                ),
            );
        }
    };

    // 8. Schema.
    let (details, total) = schemas.violations(version, &payload);
    if total == 0 {
        return Verdict::Admitted {
            schema_version: Some(version),
        };
    }
    let first = &details[0];
    let at = if first.path.is_empty() {
        "the payload".to_owned()
    } else {
        first.path.clone()
    };
    let shown = if total > details.len() {
        format!(" (the first {} are in details)", details.len())
    } else {
        String::new()
    };
    Verdict::Poison {
        reason: PoisonReason::SchemaInvalid,
        message: format!(
            "payload does not match schema version {version} of type {job_type}: \
             {total} violation{}{shown}, first at {at}: {}. Fix the payload, or send the \
             schema_version it was written for.",
            if total == 1 { "" } else { "s" },
            first.message,
        ),
        details,
    }
}

pub use crate::envelope::payload_sha256;

/// A payload's first bytes as text, at most `max` bytes of it.
///
/// For UTF-8 input the preview is exactly a prefix of it, and a cut never
/// splits a character. Bytes that are not UTF-8 (a binary payload: an image,
/// protobuf, a compressed body) are shown as U+FFFD, as
/// `String::from_utf8_lossy` does, so a binary payload previews as what text
/// it holds rather than as nothing; [`preview_is_binary`] tells the two
/// apart. NUL becomes U+FFFD as well (a database's text column may refuse
/// it). The raw bytes stay available through the payload itself.
pub fn payload_preview(bytes: &[u8], max: usize) -> std::borrow::Cow<'_, str> {
    let head = &bytes[..cut_point(bytes, max)];
    let mut text = String::from_utf8_lossy(head);
    if text.contains('\0') {
        // NUL is shown as U+FFFD too: PostgreSQL's `text` cannot hold it,
        // and a store that could not write the preview could not keep the
        // dead letter at all.
        text = std::borrow::Cow::Owned(text.replace('\0', "\u{FFFD}"));
    }
    if text.len() > max {
        // Each U+FFFD takes 3 bytes where it stands for 1: cut again, on a
        // character boundary, to stay within `max`.
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.to_mut().truncate(end);
    }
    text
}

/// Where a preview of `bytes` ends: `max`, or before it when a valid
/// character starts before `max` and ends after it (that character is left
/// out whole, not shown as U+FFFD).
fn cut_point(bytes: &[u8], max: usize) -> usize {
    if bytes.len() <= max {
        return bytes.len();
    }
    for back in 1..=max.min(3) {
        let start = max - back;
        let lead = bytes[start];
        if lead & 0xC0 == 0x80 {
            continue; // a continuation byte: the character began earlier
        }
        let width = match lead {
            0x00..=0x7F => 1,
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            _ => 4,
        };
        let end = (start + width).min(bytes.len());
        let whole = width > back && std::str::from_utf8(&bytes[start..end]).is_ok();
        return if whole { start } else { max };
    }
    max
}

/// Whether a preview made by [`payload_preview`] stands for a payload that
/// is not text: it holds U+FFFD (bytes that are not UTF-8) or a control
/// character other than tab, line feed and carriage return. JSON never
/// holds either raw; a text payload that holds U+FFFD itself reads as
/// binary too.
pub fn preview_is_binary(preview: &str) -> bool {
    preview.chars().any(|c| {
        c == char::REPLACEMENT_CHARACTER || (c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
    })
}

fn parse_json(bytes: &[u8]) -> Result<Value, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "it is not UTF-8 (first bad byte at offset {})",
            e.valid_up_to()
        )
    })?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

fn unknown_type_message(config: &AdmissionConfig, job_type: &str) -> String {
    let listed = config.types.len();
    let mut known = join(config.types.keys().take(LISTED_TYPES_MAX));
    if listed == 0 {
        known = "none are configured".to_owned();
    } else if listed > LISTED_TYPES_MAX {
        known.push_str(&format!(" and {} more", listed - LISTED_TYPES_MAX));
    }
    format!(
        "type {} is not configured and this server accepts only known types \
         (accept_unknown_types = false); known types: {known}. Use one of them, or ask \
         the operator to add [types.{}] to the config.",
        echo(job_type),
        echo(job_type).trim_matches('"'),
    )
}

/// A producer-supplied name, quoted and cut so that a message stays small.
fn echo(s: &str) -> String {
    let mut shown = s.to_owned();
    truncate_head(&mut shown, ECHO_BYTES_MAX);
    format!("{shown:?}")
}

fn join<T: fmt::Display>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    use expect_test::expect;
    use proptest::prelude::*;
    use serde_json::json;

    fn email_v1() -> Value {
        json!({
            "type": "object",
            "required": ["to", "subject"],
            "properties": {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "recipient": {
                    "type": "object",
                    "required": ["address"],
                    "properties": {"address": {"type": "string"}}
                }
            }
        })
    }

    fn email_v2() -> Value {
        json!({
            "type": "object",
            "required": ["to", "template"],
            "properties": {"to": {"type": "string"}, "template": {"type": "string"}}
        })
    }

    fn strict_v1() -> Value {
        json!({
            "type": "object",
            "required": ["id"],
            "properties": {"id": {"type": "integer"}},
            "additionalProperties": false
        })
    }

    fn many_v1() -> Value {
        json!({"type": "array", "items": {"type": "string"}})
    }

    fn config() -> AdmissionConfig {
        let mut types = BTreeMap::new();
        for (name, versions) in [
            ("send_email", vec![(1, email_v1()), (2, email_v2())]),
            ("strict", vec![(1, strict_v1())]),
            ("many", vec![(1, many_v1())]),
            ("free_form", vec![]),
        ] {
            let ty = JobType::new(name);
            let schemas = TypeSchemas::compile(&ty, versions.into_iter().collect()).unwrap();
            types.insert(ty, schemas);
        }
        AdmissionConfig {
            types,
            ..AdmissionConfig::default()
        }
    }

    fn req<'a>(job_type: &'a str, payload: &'a str) -> AdmissionRequest<'a> {
        AdmissionRequest {
            job_type: Some(job_type),
            tenant: Some("acme"),
            payload: payload.as_bytes(),
            ..AdmissionRequest::default()
        }
    }

    const GOOD_V1: &str = r#"{"to": "a@example.com", "subject": "hi"}"#;
    const GOOD_V2: &str = r#"{"to": "a@example.com", "template": "welcome"}"#;

    fn poison_reason(v: &Verdict) -> PoisonReason {
        v.poison_reason()
            .unwrap_or_else(|| panic!("expected POISON, got {v:?}"))
    }

    #[test]
    fn defaults_follow_the_contract() {
        let c = AdmissionConfig::default();
        assert_eq!(c.payload_bytes_max, 262_144);
        assert!(c.accept_unknown_types);
        assert!(c.types.is_empty());
        assert_eq!(c.body_bytes_max(), 262_144 + 16 * 1024);
    }

    #[test]
    fn config_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<AdmissionConfig>();
        assert_send_sync::<Verdict>();
    }

    #[test]
    fn v1_and_v2_are_both_admitted_and_absent_version_means_latest() {
        let c = config();
        let v1 = AdmissionRequest {
            schema_version: Some(1),
            ..req("send_email", GOOD_V1)
        };
        assert_eq!(
            admit(&c, &v1),
            Verdict::Admitted {
                schema_version: Some(1)
            }
        );
        let v2 = AdmissionRequest {
            schema_version: Some(2),
            ..req("send_email", GOOD_V2)
        };
        assert_eq!(
            admit(&c, &v2),
            Verdict::Admitted {
                schema_version: Some(2)
            }
        );
        assert_eq!(
            admit(&c, &req("send_email", GOOD_V2)),
            Verdict::Admitted {
                schema_version: Some(2)
            }
        );
        // A v1 payload without a version is checked against v2 and fails.
        assert_eq!(
            poison_reason(&admit(&c, &req("send_email", GOOD_V1))),
            PoisonReason::SchemaInvalid
        );
    }

    #[test]
    fn an_unknown_field_is_tolerated() {
        let payload = r#"{"to": "a@example.com", "template": "t", "utm_source": "x"}"#;
        assert!(admit(&config(), &req("send_email", payload)).is_admitted());
    }

    #[test]
    fn additional_properties_false_rejects_an_unknown_field() {
        let v = admit(&config(), &req("strict", r#"{"id": 7, "extra": true}"#));
        assert_eq!(poison_reason(&v), PoisonReason::SchemaInvalid);
        let Verdict::Poison { details, .. } = &v else {
            unreachable!()
        };
        assert_eq!(details.len(), 1);
        assert!(details[0].message.contains("extra"), "{details:?}");
        assert!(admit(&config(), &req("strict", r#"{"id": 7}"#)).is_admitted());
    }

    #[test]
    fn a_missing_required_field_names_its_path() {
        let v = admit(&config(), &req("send_email", r#"{"template": "t"}"#));
        let Verdict::Poison {
            reason: PoisonReason::SchemaInvalid,
            details,
            message,
        } = &v
        else {
            panic!("expected schema_invalid, got {v:?}")
        };
        assert_eq!(
            details,
            &[Violation {
                path: String::new(),
                message: "\"to\" is a required property".to_owned()
            }]
        );
        assert!(
            message.contains("schema version 2 of type send_email"),
            "{message}"
        );

        // Nested: the path is the object that lacks the field.
        let nested = AdmissionRequest {
            schema_version: Some(1),
            ..req(
                "send_email",
                r#"{"to": "a", "subject": "s", "recipient": {"name": "Ann"}}"#,
            )
        };
        let Verdict::Poison { details, .. } = admit(&config(), &nested) else {
            panic!("expected poison")
        };
        assert_eq!(details.len(), 1);
        assert_eq!(details[0].path, "/recipient");
        assert!(details[0].message.contains("\"address\""), "{details:?}");
    }

    #[test]
    fn violation_messages_mask_payload_values() {
        let secret = "x".repeat(10_000);
        let payload = format!(r#"{{"to": 1, "template": ["{secret}"]}}"#);
        let Verdict::Poison {
            details, message, ..
        } = admit(&config(), &req("send_email", &payload))
        else {
            panic!("expected poison")
        };
        assert_eq!(details.len(), 2);
        assert!(
            details.iter().all(|d| !d.message.contains("xxxx")),
            "{details:?}"
        );
        assert!(message.len() < 1024, "{message}");
        assert_eq!(details[0].path, "/template");
        assert_eq!(details[1].path, "/to");
    }

    #[test]
    fn unknown_schema_version_lists_the_known_ones() {
        let r = AdmissionRequest {
            schema_version: Some(3),
            ..req("send_email", GOOD_V2)
        };
        let v = admit(&config(), &r);
        assert_eq!(poison_reason(&v), PoisonReason::UnknownSchemaVersion);
        assert!(
            v.message().unwrap().starts_with(
                "schema version 3 is unknown for type send_email; known versions: 1, 2"
            )
        );
    }

    #[test]
    fn a_type_without_schemas_needs_only_valid_json() {
        let c = config();
        assert_eq!(
            admit(&c, &req("free_form", "null")),
            Verdict::Admitted {
                schema_version: None
            }
        );
        let versioned = AdmissionRequest {
            schema_version: Some(9),
            ..req("free_form", "[1, 2]")
        };
        assert_eq!(
            admit(&c, &versioned),
            Verdict::Admitted {
                schema_version: Some(9)
            }
        );
        assert_eq!(
            poison_reason(&admit(&c, &req("free_form", "{oops"))),
            PoisonReason::InvalidJson
        );
    }

    #[test]
    fn unknown_types_follow_accept_unknown_types() {
        let mut c = config();
        assert_eq!(
            admit(&c, &req("resize_image", r#"{"any": "thing"}"#)),
            Verdict::Admitted {
                schema_version: None
            }
        );
        c.accept_unknown_types = false;
        let v = admit(&c, &req("resize_image", r#"{"any": "thing"}"#));
        assert_eq!(v.code(), "UNKNOWN_TYPE");
        assert!(
            v.message()
                .unwrap()
                .contains("free_form, many, send_email, strict")
        );
        assert!(admit(&c, &req("free_form", "{}")).is_admitted());
    }

    #[test]
    fn invalid_json_is_poison() {
        let c = config();
        for bad in [
            "",
            "{",
            "{\"a\": 1} trailing",
            "\u{feff}{}",
            "[1,]",
            "\"\\ud800\"",
        ] {
            assert_eq!(
                poison_reason(&admit(&c, &req("free_form", bad))),
                PoisonReason::InvalidJson,
                "{bad:?}"
            );
        }
        let not_utf8 = AdmissionRequest {
            payload: b"\"\xff\"",
            ..req("free_form", "")
        };
        let v = admit(&c, &not_utf8);
        assert!(v.message().unwrap().contains("not UTF-8"), "{v:?}");
    }

    #[test]
    fn blank_tenants_are_no_tenant() {
        for tenant in [None, Some(""), Some("   "), Some("\t\n")] {
            let r = AdmissionRequest {
                tenant,
                ..req("send_email", GOOD_V2)
            };
            assert_eq!(admit(&config(), &r).code(), "NO_TENANT", "{tenant:?}");
        }
    }

    #[test]
    fn blank_job_types_are_bad_requests() {
        for job_type in [None, Some(""), Some("  ")] {
            let r = AdmissionRequest {
                job_type,
                ..req("x", "{}")
            };
            assert_eq!(admit(&config(), &r).code(), "BAD_REQUEST", "{job_type:?}");
        }
    }

    #[test]
    fn declared_size_over_the_cap_is_poison_even_when_the_slice_is_short() {
        let r = AdmissionRequest {
            declared_size: Some(300_000),
            ..req("send_email", GOOD_V2)
        };
        let v = admit(&config(), &r);
        assert_eq!(poison_reason(&v), PoisonReason::PayloadTooLarge);
        assert!(v.message().unwrap().starts_with("payload is 300000 bytes"));
        // At the cap exactly is fine.
        let at_cap = AdmissionRequest {
            declared_size: Some(262_144),
            ..req("send_email", GOOD_V2)
        };
        assert!(admit(&config(), &at_cap).is_admitted());
    }

    #[test]
    fn check_size_and_check_body_size_draw_the_line_at_the_cap() {
        let c = config();
        assert_eq!(check_size(&c, 262_144), None);
        assert_eq!(
            check_size(&c, 262_145).and_then(|v| v.poison_reason()),
            Some(PoisonReason::PayloadTooLarge)
        );
        assert_eq!(check_body_size(&c, 262_144 + 16_384), None);
        assert_eq!(
            check_body_size(&c, 262_144 + 16_385).and_then(|v| v.poison_reason()),
            Some(PoisonReason::PayloadTooLarge)
        );
    }

    #[test]
    fn shed_carries_retry_after() {
        let r = AdmissionRequest {
            shed: Some(Duration::from_millis(1500)),
            ..req("send_email", GOOD_V2)
        };
        let v = admit(&config(), &r);
        assert_eq!(v.code(), "SHED");
        let Verdict::Shed { retry_after, .. } = v else {
            unreachable!()
        };
        assert_eq!(retry_after, Duration::from_millis(1500));
    }

    /// Each request breaks every rule from its step on; the verdict names the
    /// earliest step, which is the documented order.
    #[test]
    fn checks_run_in_the_documented_order() {
        let mut c = config();
        c.accept_unknown_types = false;
        c.payload_bytes_max = 64;
        const BIG: &[u8] = &[b'{'; 100]; // too large and not JSON
        let all_bad = AdmissionRequest {
            job_type: None,
            tenant: None,
            schema_version: Some(7),
            payload: BIG,
            declared_size: None,
            shed: Some(Duration::from_secs(1)),
        };
        type Fix = fn(&mut AdmissionRequest<'static>);
        let steps: [(&str, Fix); 7] = [
            ("POISON payload_too_large", |r| r.payload = &b"{oops"[..]),
            ("BAD_REQUEST", |r| r.job_type = Some("nope")),
            ("NO_TENANT", |r| r.tenant = Some("acme")),
            ("UNKNOWN_TYPE", |r| r.job_type = Some("send_email")),
            ("SHED", |r| r.shed = None),
            ("POISON invalid_json", |r| r.payload = &b"{\"to\": 1}"[..]),
            ("POISON unknown_schema_version", |r| {
                r.schema_version = Some(2)
            }),
        ];
        let mut r = all_bad;
        let mut seen = Vec::new();
        for (expected, fix) in steps {
            let v = admit(&c, &r);
            let got = match v.poison_reason() {
                Some(p) => format!("POISON {}", p.as_str()),
                None => v.code().to_owned(),
            };
            seen.push(got.clone());
            assert_eq!(got, expected, "after {seen:?}");
            fix(&mut r);
        }
        assert_eq!(poison_reason(&admit(&c, &r)), PoisonReason::SchemaInvalid);
    }

    #[test]
    fn messages_say_what_to_do() {
        let mut c = config();
        c.accept_unknown_types = false;
        let cases = [
            AdmissionRequest {
                declared_size: Some(300_000),
                ..req("send_email", "{}")
            },
            AdmissionRequest {
                job_type: None,
                ..req("", "{}")
            },
            AdmissionRequest {
                tenant: Some(" "),
                ..req("send_email", "{}")
            },
            req("resize_image", "{}"),
            AdmissionRequest {
                shed: Some(Duration::from_millis(2500)),
                ..req("send_email", "{}")
            },
            req("send_email", "{\"to\": "),
            AdmissionRequest {
                schema_version: Some(3),
                ..req("send_email", "{}")
            },
            req("send_email", r#"{"to": 5}"#),
        ];
        let mut out = String::new();
        for r in &cases {
            let v = admit(&c, r);
            out.push_str(&format!("{}: {}\n", v.code(), v.message().unwrap()));
        }
        expect![[r#"
            POISON: payload is 300000 bytes; the cap is 262144 bytes (payload_bytes_max). Store large blobs elsewhere and enqueue a reference.
            BAD_REQUEST: job type is missing or empty; set "type" on every job (for example "send_email")
            NO_TENANT: tenant is missing or empty; set "tenant" on every job
            UNKNOWN_TYPE: type "resize_image" is not configured and this server accepts only known types (accept_unknown_types = false); known types: free_form, many, send_email, strict. Use one of them, or ask the operator to add [types.resize_image] to the config.
            SHED: type "send_email" is not taking jobs now (its breaker is open or the type or lane is paused); retry after 2500 ms (Retry-After) rather than at once
            POISON: payload is not valid JSON: EOF while parsing a value at line 1 column 7. Send the payload as one UTF-8 JSON value (object, array, string, number, true, false or null).
            POISON: schema version 3 is unknown for type send_email; known versions: 1, 2. Send one of them, or omit schema_version for the latest (2).
            POISON: payload does not match schema version 2 of type send_email: 2 violations, first at the payload: "template" is a required property. Fix the payload, or send the schema_version it was written for.
        "#]]
        .assert_eq(&out);
    }

    #[test]
    fn details_are_capped_and_the_message_says_so() {
        let payload = serde_json::to_string(&(0..50).collect::<Vec<u32>>()).unwrap();
        let Verdict::Poison {
            details, message, ..
        } = admit(&config(), &req("many", &payload))
        else {
            panic!("expected poison")
        };
        assert_eq!(details.len(), VIOLATIONS_MAX);
        assert_eq!(details[0].path, "/0");
        assert!(
            message.contains("50 violations (the first 20 are in details)"),
            "{message}"
        );
    }

    #[test]
    fn a_broken_schema_names_type_and_version() {
        let ty = JobType::new("send_email");
        let versions = BTreeMap::from([
            (1, email_v1()),
            (
                2,
                json!({"type": "object", "properties": {"to": {"type": "strin"}}}),
            ),
        ]);
        let err = TypeSchemas::compile(&ty, versions).unwrap_err();
        assert_eq!(err.job_type, ty);
        assert_eq!(err.version, 2);
        let text = err.to_string();
        assert!(
            text.starts_with("schema version 2 of type send_email is not a usable JSON Schema"),
            "{text}"
        );
        assert!(text.contains("/properties/to/type"), "{text}");
        assert!(text.contains("[types.send_email]"), "{text}");
    }

    #[test]
    fn external_refs_are_never_fetched() {
        let ty = JobType::new("remote");
        let versions = BTreeMap::from([(1, json!({"$ref": "https://example.com/s.json"}))]);
        let err = TypeSchemas::compile(&ty, versions).unwrap_err();
        assert_eq!(err.version, 1);
    }

    #[test]
    fn type_schemas_report_versions() {
        let ty = JobType::new("send_email");
        let s =
            TypeSchemas::compile(&ty, BTreeMap::from([(2, email_v2()), (1, email_v1())])).unwrap();
        assert_eq!(s.latest(), Some(2));
        assert_eq!(s.versions().collect::<Vec<_>>(), [1, 2]);
        assert!(s.contains(1) && !s.contains(3) && !s.is_empty());
        assert_eq!(format!("{s:?}"), "TypeSchemas { versions: [1, 2] }");
        assert_eq!(TypeSchemas::default().latest(), None);
    }

    #[test]
    fn sha256_and_preview() {
        assert_eq!(
            hex::encode(payload_sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(payload_preview("héllo".as_bytes(), 2), "h");
        assert_eq!(payload_preview("héllo".as_bytes(), 3), "hé");
        assert_eq!(payload_preview(b"ab\xffcd", 10), "ab\u{FFFD}cd");
        // Within the cap although each U+FFFD takes 3 bytes for 1.
        assert_eq!(payload_preview(b"\xff\xff\xff\xff", 4), "\u{FFFD}");
        assert_eq!(payload_preview(b"\x89PNG", 10), "\u{FFFD}PNG");
        assert!(preview_is_binary(&payload_preview(b"\x89PNG\r\n", 10)));
        assert!(preview_is_binary("\u{0}\u{1}"));
        assert_eq!(payload_preview(b"a\0b", 10), "a\u{FFFD}b");
        assert_eq!(payload_preview(b"\0\0", 4), "\u{FFFD}");
        assert!(!preview_is_binary("{\"a\": \"h\u{e9}llo\"}\r\n\t"));
        assert!(!preview_is_binary(""));
        assert_eq!(payload_preview(b"abc", PREVIEW_BYTES_MAX), "abc");
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..40).prop_map(Value::from),
                prop::collection::btree_map("[a-z]{1,6}", inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn admit_never_panics(
            payload in prop::collection::vec(any::<u8>(), 0..512),
            job_type in prop::option::of(prop_oneof![
                Just("send_email".to_owned()), Just("strict".to_owned()),
                Just("many".to_owned()), Just("free_form".to_owned()), ".{0,6}",
            ]),
            tenant in prop::option::of(".{0,4}"),
            schema_version in prop::option::of(0u32..4),
            declared_size in prop::option::of(any::<u64>()),
            shed_ms in prop::option::of(any::<u32>()),
            cap in 0usize..600,
            accept_unknown_types in any::<bool>(),
        ) {
            let c = AdmissionConfig { payload_bytes_max: cap, accept_unknown_types, ..config() };
            let r = AdmissionRequest {
                job_type: job_type.as_deref(),
                tenant: tenant.as_deref(),
                schema_version,
                payload: &payload,
                declared_size,
                shed: shed_ms.map(|ms| Duration::from_millis(ms.into())),
            };
            let v = admit(&c, &r);
            prop_assert_eq!(v.is_admitted(), v.message().is_none());
        }

        #[test]
        fn over_the_cap_is_always_payload_too_large(
            payload in prop::collection::vec(any::<u8>(), 1..300),
            cap in 0usize..300,
            job_type in prop::option::of(".{0,6}"),
            tenant in prop::option::of(".{0,4}"),
        ) {
            prop_assume!(payload.len() > cap);
            let c = AdmissionConfig { payload_bytes_max: cap, ..config() };
            let r = AdmissionRequest {
                job_type: job_type.as_deref(),
                tenant: tenant.as_deref(),
                payload: &payload,
                shed: Some(Duration::from_secs(1)),
                ..AdmissionRequest::default()
            };
            prop_assert_eq!(admit(&c, &r).poison_reason(), Some(PoisonReason::PayloadTooLarge));
        }

        #[test]
        fn details_never_exceed_the_cap(
            value in arb_json(),
            job_type in prop_oneof![Just("send_email"), Just("strict"), Just("many")],
        ) {
            let payload = value.to_string();
            let v = admit(&config(), &req(job_type, &payload));
            if let Verdict::Poison { details, reason, .. } = &v {
                prop_assert_eq!(*reason, PoisonReason::SchemaInvalid);
                prop_assert!(!details.is_empty() && details.len() <= VIOLATIONS_MAX);
            }
        }

        #[test]
        fn preview_is_a_bounded_utf8_prefix(
            text in "[^\u{0}]{0,64}",
            noise in prop::collection::vec(any::<u8>(), 0..64),
            max in 0usize..80,
        ) {
            let p = payload_preview(text.as_bytes(), max);
            prop_assert!(p.len() <= max);
            prop_assert!(text.starts_with(&*p));
            // Lossless: nothing that fits is dropped.
            prop_assert!(text.len() <= max || max - p.len() < 4);
            if text.len() <= max {
                prop_assert_eq!(p, text.as_str());
            }

            let p = payload_preview(&noise, max);
            prop_assert!(p.len() <= max);
            // Lossy: what is UTF-8 in the head is shown as it is.
            let lossy = String::from_utf8_lossy(&noise[..noise.len().min(max)]);
            let lossy = lossy.replace('\0', "\u{FFFD}");
            let shown = p.trim_end_matches(char::REPLACEMENT_CHARACTER);
            prop_assert!(lossy.starts_with(shown), "{:?} {:?}", p, lossy);
        }
    }
}
