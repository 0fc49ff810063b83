//! Bounds on hostile input: every value that comes from a broker message, a
//! handler's answer or a config file, as one set of pure rules.
//!
//! A broker message is written by whoever can publish to the queue, and a
//! handler's answer by whatever sits at the `deliver` URL (a proxy's error
//! page included). Neither is trusted: this module says which names are
//! taken as given and which fall back, which text may go into an HTTP
//! header, how much of an answer is read, how an attempt header is counted,
//! and how a URL is shown without its credentials. The adapters and the
//! HTTP handler call it; none of them bounds a value on its own.

use crate::ids::{NAME_BYTES_MAX, NameError, check_name};

/// The most of a handler's error answer read (the rest is never read: the
/// connection is dropped). Enough for any JSON error body and a long
/// traceback; a 200 MB proxy page costs no more than this.
pub const ERROR_BODY_BYTES_MAX: usize = 64 * 1024;

/// The longest message and traceback kept of any failure, a handler's
/// included ([`crate::Failure::truncate_to_caps`] applies them).
pub use crate::failure::{MESSAGE_BYTES_MAX, TRACEBACK_BYTES_MAX};

/// The longest redirect target quoted in a failure's message.
pub const QUOTED_URL_BYTES_MAX: usize = 1024;

/// The longest `Lazaret-Headers` value sent to a handler. nginx's default
/// 8 KiB header buffer must also hold the name and the other headers;
/// Node's whole header block is 16 KiB.
pub const HEADERS_LINE_BYTES_MAX: usize = 6 * 1024;

/// A name (job type, tenant, error kind) taken from hostile input, when it
/// follows the API's rule ([`check_name`] at [`NAME_BYTES_MAX`]) and is not
/// empty; `None` tells the caller to use its fallback (the source's type,
/// the default tenant, `http_<status>`).
pub fn bounded_name(value: &str) -> Option<&str> {
    (!value.is_empty() && check_name("name", value, NAME_BYTES_MAX).is_ok()).then_some(value)
}

/// A name written in a config file, checked with the API's rule; the error
/// names `key` (the caller adds the file and line).
pub fn check_config_name(key: &str, value: &str) -> Result<(), NameError> {
    check_name(key, value, NAME_BYTES_MAX)
}

/// Whether `s` can be sent as an HTTP header value as it is: visible
/// ASCII, spaces and tabs, no leading or trailing whitespace (which HTTP
/// strips, so the handler would see another value), nothing else. CR, LF
/// and NUL would split or end the header; bytes above ASCII are refused by
/// many servers.
pub fn is_header_value(s: &str) -> bool {
    s.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
        && !s.starts_with([' ', '\t'])
        && !s.ends_with([' ', '\t'])
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Hostile text fit for one line of a message: control characters escaped
/// (`\n`, `\u{0}`), at most `max` bytes of the original, `…` when cut.
pub fn quote_line(s: &str, max: usize) -> String {
    let kept = cut(s, max);
    let mut out: String = kept.chars().flat_map(char::escape_debug).collect();
    if kept.len() < s.len() {
        out.push('…');
    }
    out
}

/// The attempts a message's `x-lazaret-attempt` header says were charged
/// already: a decimal integer ≥ 0 (surrounding spaces allowed), saturating
/// at `u32::MAX`. Anything else — missing, empty, negative, fractional, not
/// a number, not UTF-8 — is malformed and counts as 0: a message lazaret
/// cannot count is treated as new, and the budgets bound it from there on.
/// A count at or over `attempts_max` means the budget is spent, and the
/// message is dead-lettered without a delivery
/// ([`crate::absorb_earlier_deliveries`]).
pub fn normalize_attempt_header(raw: Option<&[u8]>) -> u32 {
    let Some(raw) = raw else { return 0 };
    let Ok(text) = std::str::from_utf8(raw) else {
        return 0;
    };
    let digits = text.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return 0;
    }
    // All digits: only its size can make it fail to parse.
    digits.parse::<u32>().unwrap_or(u32::MAX)
}

/// A URL as lazaret prints or stores it: the whole user info (`user`,
/// `user:password`, a NATS or Redis token) replaced by `***`, so no
/// credential reaches a log line, an error or a dead letter. Text that is
/// not a URL with user info comes back as it is.
pub fn mask_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    // The authority ends at the first `/`, `?` or `#`; the user info is
    // what comes before its last `@`.
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_len].rfind('@') {
        Some(at) => format!("{}***{}", &url[..scheme_end], &rest[at..]),
        None => url.to_owned(),
    }
}

/// `text` with every occurrence of `url` masked ([`mask_url`]): for error
/// messages of libraries that quote the URL they were given.
pub fn mask_url_in(text: &str, url: &str) -> String {
    let masked = mask_url(url);
    if masked == url || url.is_empty() {
        return text.to_owned();
    }
    text.replace(url, &masked)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn names_follow_the_api_rule_or_fall_back() {
        assert_eq!(bounded_name("tasks.add"), Some("tasks.add"));
        assert_eq!(bounded_name(""), None);
        assert_eq!(bounded_name("a\nb"), None);
        assert_eq!(bounded_name("a\0b"), None);
        assert_eq!(bounded_name(&"x".repeat(128)).map(str::len), Some(128));
        assert_eq!(bounded_name(&"x".repeat(129)), None);
        assert_eq!(bounded_name(&"x".repeat(100_000)), None);
        let e = check_config_name("types.\"a\\nb\"", "a\nb").unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
    }

    #[test]
    fn header_values_are_visible_ascii() {
        assert!(is_header_value("application/json; charset=utf-8"));
        assert!(is_header_value(""));
        for bad in [
            "text/plain\r\nX-Evil: 1",
            "a\nb",
            "a\0b",
            "tëxt",
            " x",
            "x ",
            "a\x7fb",
        ] {
            assert!(!is_header_value(bad), "{bad:?}");
        }
    }

    #[test]
    fn cutting_keeps_characters_whole() {
        assert_eq!(cut("héllo", 2), "h");
        assert_eq!(cut("héllo", 3), "hé");
        assert_eq!(cut("abc", 10), "abc");
        assert_eq!(quote_line("a\nb\0", 100), "a\\nb\\0");
        assert_eq!(quote_line("abcdef", 3), "abc…");
    }

    #[test]
    fn attempt_header_takes_any_integer_from_zero_and_saturates() {
        assert_eq!(normalize_attempt_header(None), 0);
        assert_eq!(normalize_attempt_header(Some(b"")), 0);
        assert_eq!(normalize_attempt_header(Some(b"abc")), 0);
        assert_eq!(normalize_attempt_header(Some(b"-3")), 0);
        assert_eq!(normalize_attempt_header(Some(b"-0")), 0);
        assert_eq!(normalize_attempt_header(Some(b"+3")), 0);
        assert_eq!(normalize_attempt_header(Some(b"2.5")), 0);
        assert_eq!(normalize_attempt_header(Some(b"1e3")), 0);
        assert_eq!(normalize_attempt_header(Some(&[0xff, 0xfe])), 0);
        assert_eq!(normalize_attempt_header(Some(b" 4 ")), 4);
        assert_eq!(normalize_attempt_header(Some(b"2147483648")), 1 << 31);
        assert_eq!(normalize_attempt_header(Some(b"4294967295")), u32::MAX);
        assert_eq!(normalize_attempt_header(Some(b"4294967296")), u32::MAX);
        assert_eq!(
            normalize_attempt_header(Some(b"9223372036854775807")),
            u32::MAX
        );
        assert_eq!(
            normalize_attempt_header(Some(&[b'9'; 400])),
            u32::MAX,
            "any length of digits"
        );
    }

    proptest! {
        #[test]
        fn attempt_header_is_the_integer_saturated(n in any::<u128>()) {
            let text = n.to_string();
            let want = u32::try_from(n).unwrap_or(u32::MAX);
            prop_assert_eq!(normalize_attempt_header(Some(text.as_bytes())), want);
        }

        #[test]
        fn a_negative_attempt_header_is_malformed(n in 1..=i128::MAX) {
            let text = format!("-{n}");
            prop_assert_eq!(normalize_attempt_header(Some(text.as_bytes())), 0);
        }

        #[test]
        fn masked_urls_never_hold_their_user_info(
            user in "[a-zA-Z0-9._~%-]{1,20}",
            pass in proptest::option::of("[a-zA-Z0-9._~%!$&'()*+,;=:-]{1,20}"),
            scheme in "(amqp|nats|redis|http|https|postgres)",
        ) {
            let info = match &pass {
                Some(p) => format!("{user}:{p}"),
                None => user.clone(),
            };
            let url = format!("{scheme}://{info}@host.example:1234/path?q=1");
            let masked = mask_url(&url);
            prop_assert_eq!(&masked, &format!("{scheme}://***@host.example:1234/path?q=1"));
            let text = format!("error sending request for url ({url}): refused");
            let leaked = format!("{info}@");
            prop_assert!(!mask_url_in(&text, &url).contains(&leaked));
        }
    }

    #[test]
    fn the_whole_user_info_is_masked() {
        assert_eq!(
            mask_url("nats://s3cr3tT0ken@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(
            mask_url("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            mask_url("http://u:p@h/a@b?c=d@e"),
            "http://***@h/a@b?c=d@e",
            "an @ in the path is not user info"
        );
        assert_eq!(mask_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(mask_url("127.0.0.1:9092"), "127.0.0.1:9092");
        assert_eq!(
            mask_url_in("POST http://u:pw@h/x failed", "http://u:pw@h/x"),
            "POST http://***@h/x failed"
        );
    }
}
