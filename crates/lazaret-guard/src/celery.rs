//! Celery task messages (protocol 2): headers `task`, `id`, `retries`,
//! `argsrepr`, `kwargsrepr`; a body `[args, kwargs, embed]`, JSON when the
//! content type says so. A body that is not JSON is never deserialised:
//! `argsrepr` and `kwargsrepr` say what the arguments were.

use serde_json::{Map, Value};

use crate::message::header_text;

/// What lazaret reads of a Celery task message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    /// The task's name (`tasks.add`): the dead letter's type.
    pub name: String,
    /// The task id: the dead letter's idempotency key, and kept on redrive.
    pub id: String,
    /// Celery's own retry count, when present.
    pub retries: Option<u32>,
}

impl Task {
    /// A task message's name and id, when `headers` are Celery's protocol 2.
    pub fn recognise(headers: &Map<String, Value>) -> Option<Task> {
        let name = headers.get("task").and_then(header_text)?;
        let id = headers.get("id").and_then(header_text)?;
        if name.is_empty() || id.is_empty() {
            return None;
        }
        Some(Task {
            name,
            id,
            retries: headers
                .get("retries")
                .and_then(header_text)
                .and_then(|r| r.parse().ok()),
        })
    }
}

/// The arguments of a task message, readable: `{"args", "kwargs"}` from a
/// JSON body, else `{"argsrepr", "kwargsrepr"}` from the headers.
pub fn arguments(headers: &Map<String, Value>, content_type: Option<&str>, body: &[u8]) -> Value {
    let json_body = content_type.is_none_or(|c| c.contains("json"));
    if json_body {
        if let Ok(Value::Array(parts)) = serde_json::from_slice::<Value>(body) {
            if parts.len() >= 2 {
                return serde_json::json!({"args": parts[0], "kwargs": parts[1]});
            }
        }
    }
    serde_json::json!({
        "argsrepr": headers.get("argsrepr").cloned().unwrap_or(Value::Null),
        "kwargsrepr": headers.get("kwargsrepr").cloned().unwrap_or(Value::Null),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn protocol_2_headers_name_the_task() {
        let h = map(json!({"task": "tasks.add", "id": "5f1c", "retries": 2, "lang": "py"}));
        assert_eq!(
            Task::recognise(&h),
            Some(Task {
                name: "tasks.add".into(),
                id: "5f1c".into(),
                retries: Some(2)
            })
        );
        assert_eq!(Task::recognise(&map(json!({"id": "x"}))), None);
    }

    #[test]
    fn arguments_come_from_a_json_body_or_else_the_reprs() {
        let h = map(json!({"argsrepr": "(1, 2)", "kwargsrepr": "{}"}));
        assert_eq!(
            arguments(&h, Some("application/json"), br#"[[1, 2], {"x": 3}, {}]"#),
            json!({"args": [1, 2], "kwargs": {"x": 3}})
        );
        assert_eq!(
            arguments(&h, Some("application/x-python-serialize"), b"\x80\x04"),
            json!({"argsrepr": "(1, 2)", "kwargsrepr": "{}"})
        );
    }
}
