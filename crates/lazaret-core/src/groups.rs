//! Failure groups: the unit an operator triages dead letters by.
//!
//! A dead letter's group is (type, reason, kind, fingerprint of the error
//! message, first frame of the traceback when there is one), named by a
//! stable id, [`group_id`]: a hash of those, the same on every node and
//! across restarts, so a group found in the dashboard can be redriven,
//! purged or archived by its id.
//!
//! The message's fingerprint is [`crate::stats::fingerprint`] (numbers,
//! ids, UUIDs, e-mail addresses and quoted values normalised) after file
//! paths are replaced by `<path>` ([`group_fingerprint`]), so that "cannot
//! open /data/in/17.csv" and "cannot open /srv/x/a.csv" fall together.
//! The traceback's first frame ([`first_frame`]) keeps its file and
//! function but not its line numbers, so a deploy that moves a line does
//! not split a group.

use sha2::{Digest, Sha256};

use crate::stats::fingerprint;

/// What a file path (`/var/data/x.csv`, `./a/b`, `~/x`, `C:\x\y`) becomes.
pub const PLACEHOLDER_PATH: &str = "<path>";

/// Longest first frame kept, in chars.
pub const FRAME_CHARS_MAX: usize = 200;

/// Hex chars of a group id (64 bits of SHA-256).
pub const GROUP_ID_HEX: usize = 16;

/// Whether a whitespace-separated word is a file path.
fn is_path(word: &str) -> bool {
    let w = word.trim_matches(|c: char| matches!(c, '\'' | '"' | '`' | '(' | ')' | ',' | ';'));
    let unix =
        (w.starts_with('/') || w.starts_with("./") || w.starts_with("../") || w.starts_with("~/"))
            && w.len() > 1
            && !w.starts_with("//");
    let bytes = w.as_bytes();
    let windows =
        bytes.len() > 3 && bytes[0].is_ascii_alphabetic() && bytes[1] == b':' && bytes[2] == b'\\';
    unix || windows
}

/// The message's fingerprint as groups use it: paths become `<path>`, then
/// [`fingerprint`] normalises the rest. Idempotent, like `fingerprint`.
pub fn group_fingerprint(message: &str) -> String {
    let mut text = String::with_capacity(message.len());
    for (i, word) in message.split_whitespace().enumerate() {
        if i > 0 {
            text.push(' ');
        }
        if is_path(word) {
            text.push_str(PLACEHOLDER_PATH);
        } else {
            text.push_str(word);
        }
    }
    fingerprint(&text)
}

/// The first frame of a traceback, line numbers and addresses replaced by
/// `<n>`: the first line that names a frame (Python `File "…", line N, in
/// f`; JVM and JavaScript `at …`; Rust `N: path::to::fn`), else `None`.
pub fn first_frame(traceback: &str) -> Option<String> {
    let line = traceback.lines().map(str::trim).find(|l| {
        l.starts_with("File ")
            || l.starts_with("at ")
            || l.split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })?;
    let mut out = String::new();
    let mut in_digits = false;
    for c in line.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push_str("<n>");
            }
            in_digits = true;
        } else {
            in_digits = false;
            out.push(c);
        }
        if out.chars().count() >= FRAME_CHARS_MAX {
            break;
        }
    }
    Some(out)
}

/// A group's stable id: the first [`GROUP_ID_HEX`] hex chars of the
/// SHA-256 of its parts, each followed by a separator no part contains.
pub fn group_id(
    job_type: Option<&str>,
    reason: &str,
    kind: Option<&str>,
    fingerprint: &str,
    frame: Option<&str>,
) -> String {
    let mut h = Sha256::new();
    for part in [
        job_type.unwrap_or(""),
        reason,
        kind.unwrap_or(""),
        fingerprint,
        frame.unwrap_or(""),
    ] {
        h.update(part.as_bytes());
        h.update([0x1f]);
    }
    let mut id = hex::encode(h.finalize());
    id.truncate(GROUP_ID_HEX);
    id
}

/// A dead letter's group: its id and its message's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// [`group_id`].
    pub id: String,
    /// [`group_fingerprint`] of the error message.
    pub fingerprint: String,
}

/// The group of a dead letter of `job_type` with `reason` and its last
/// error (kind, message, traceback), when it had one.
pub fn group_of(job_type: Option<&str>, reason: &str, error: Option<&crate::Failure>) -> Group {
    let fp = error
        .map(|e| group_fingerprint(&e.message))
        .unwrap_or_default();
    let frame = error
        .and_then(|e| e.traceback.as_deref())
        .and_then(first_frame);
    Group {
        id: group_id(
            job_type,
            reason,
            error.map(|e| e.kind.as_str()),
            &fp,
            frame.as_deref(),
        ),
        fingerprint: fp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Failure;

    #[test]
    fn normalisation_table() {
        // (message, message): each pair must fall in one group.
        let same = [
            ("order 17 failed", "order 90211 failed"),
            (
                "user 4f9c2e1a-7b3d-4c1e-9a2f-0e1d2c3b4a59 not found",
                "user 00000000-0000-0000-0000-000000000000 not found",
            ),
            (
                "blob deadbeef01234567 missing",
                "blob a1b2c3d4e5f60718 missing",
            ),
            ("user 'bob' not found", "user \"carol\" not found"),
            ("field `amount` invalid", "field `currency` invalid"),
            ("cannot open /data/in/17.csv", "cannot open /srv/x/a.csv"),
            ("cannot open ./tmp/a", "cannot open ~/b/c.txt"),
            ("cannot open C:\\data\\a.csv", "cannot open D:\\b.txt"),
            (
                "timeout after 30ms calling 10.0.0.7:443",
                "timeout after 5s calling 10.0.0.8:80",
            ),
            ("mail to bob@example.com bounced", "mail to x@y.org bounced"),
        ];
        for (a, b) in same {
            assert_eq!(group_fingerprint(a), group_fingerprint(b), "{a:?} vs {b:?}");
        }
        let apart = [
            ("order 17 failed", "order 17 refused"),
            ("http_503 from upstream", "http_404 from upstream"),
            ("cannot open /a", "cannot read /a"),
            ("a/b split", "c/d split"), // not paths: no leading / . ~ or drive
        ];
        for (a, b) in apart {
            assert_ne!(group_fingerprint(a), group_fingerprint(b), "{a:?} vs {b:?}");
        }
        assert_eq!(
            group_fingerprint("cannot open '/data/in/17.csv': no such file"),
            "cannot open <path> no such file"
        );
        for m in ["cannot open /a/b 17", "user 'x' at /y", ""] {
            let fp = group_fingerprint(m);
            assert_eq!(group_fingerprint(&fp), fp, "idempotent on {m:?}");
        }
    }

    #[test]
    fn first_frames_keep_the_place_and_drop_line_numbers() {
        let py = "Traceback (most recent call last):\n  File \"/app/tasks.py\", line 42, in charge\n    x()\nValueError: bad";
        assert_eq!(
            first_frame(py).as_deref(),
            Some("File \"/app/tasks.py\", line <n>, in charge")
        );
        let jvm = "java.lang.IllegalStateException: x\n\tat com.acme.Orders.pay(Orders.java:118)\n\tat x.y(Z.java:1)";
        assert_eq!(
            first_frame(jvm).as_deref(),
            Some("at com.acme.Orders.pay(Orders.java:<n>)")
        );
        let rust = "   0: app::orders::pay\n   1: app::main";
        assert_eq!(first_frame(rust).as_deref(), Some("<n>: app::orders::pay"));
        assert_eq!(first_frame("no frames here"), None);
    }

    #[test]
    fn the_group_id_is_stable_and_depends_on_every_part() {
        let f = |msg: &str, tb: Option<&str>| {
            let mut e = Failure::new("http_503", msg);
            e.traceback = tb.map(str::to_owned);
            e
        };
        let a = group_of(Some("send"), "exhausted", Some(&f("order 17 failed", None)));
        let b = group_of(Some("send"), "exhausted", Some(&f("order 18 failed", None)));
        assert_eq!(a, b);
        // Fixed forever: a group id is stored and named by operators.
        assert_eq!(
            a.id,
            group_id(
                Some("send"),
                "exhausted",
                Some("http_503"),
                "order <n> failed",
                None
            )
        );
        assert_eq!(a.id.len(), GROUP_ID_HEX);
        expect_test::expect!["2720e000dd37576c"].assert_eq(&a.id);
        assert_ne!(
            a.id,
            group_of(
                Some("other"),
                "exhausted",
                Some(&f("order 17 failed", None))
            )
            .id
        );
        assert_ne!(
            a.id,
            group_of(Some("send"), "permanent", Some(&f("order 17 failed", None))).id
        );
        assert_ne!(
            a.id,
            group_of(
                Some("send"),
                "exhausted",
                Some(&f("order 17 failed", Some("  File \"a.py\", line 1, in f")))
            )
            .id
        );
        let mut other_kind = f("order 17 failed", None);
        other_kind.kind = crate::ErrorKind::new("timeout");
        assert_ne!(
            a.id,
            group_of(Some("send"), "exhausted", Some(&other_kind)).id
        );
        // Lines moved by a deploy keep the group.
        assert_eq!(
            group_of(
                Some("send"),
                "exhausted",
                Some(&f("x", Some("  File \"a.py\", line 1, in f")))
            ),
            group_of(
                Some("send"),
                "exhausted",
                Some(&f("x", Some("  File \"a.py\", line 9, in f")))
            ),
        );
        assert_eq!(group_of(None, "invalid_json", None).fingerprint, "");
    }
}
