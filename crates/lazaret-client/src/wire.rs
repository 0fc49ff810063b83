//! The JSON edge: ids sent as strings, times as RFC 3339 UTC, durations as
//! integer milliseconds. Everything else in the crate sees typed values.

use std::time::{Duration, SystemTime};

use serde::Deserialize;
use serde::de::{self, Deserializer};

/// An id the API sends as a decimal string (numbers are accepted too).
pub(crate) fn parse_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Id {
        Text(String),
        Number(u64),
    }
    match Id::deserialize(d)? {
        Id::Number(n) => Ok(n),
        Id::Text(s) => s
            .trim()
            .parse()
            .map_err(|_| de::Error::custom(format!("{s:?} is not a numeric id"))),
    }
}

/// `Option` of [`parse_u64`], `null` allowed.
pub(crate) fn parse_opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "parse_u64")] u64);
    Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
}

pub(crate) mod job_id {
    //! `JobId` as the API's decimal string.
    use lazaret_core::JobId;
    use serde::{Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(id: &JobId, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&id.0)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<JobId, D::Error> {
        super::parse_u64(d).map(JobId)
    }
}

pub(crate) mod opt_job_id {
    //! `Option<JobId>` as a decimal string or `null`.
    use lazaret_core::JobId;
    use serde::Deserializer;

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<JobId>, D::Error> {
        Ok(super::parse_opt_u64(d)?.map(JobId))
    }
}

/// Reads an RFC 3339 time.
pub(crate) fn parse_time(s: &str) -> Result<SystemTime, humantime::TimestampError> {
    humantime::parse_rfc3339_weak(s)
}

pub(crate) mod time {
    //! `SystemTime` from RFC 3339 UTC.
    use std::time::SystemTime;

    use serde::Deserialize;
    use serde::de::{self, Deserializer};

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_time(&s)
            .map_err(|e| de::Error::custom(format!("{s:?} is not an RFC 3339 time: {e}")))
    }
}

pub(crate) mod opt_time {
    //! `Option<SystemTime>` as RFC 3339 UTC or `null`.
    use std::time::SystemTime;

    use serde::Deserialize;
    use serde::de::{self, Deserializer};

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<SystemTime>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(s) => super::parse_time(&s)
                .map(Some)
                .map_err(|e| de::Error::custom(format!("{s:?} is not an RFC 3339 time: {e}"))),
        }
    }
}

/// Milliseconds of a duration for the JSON edge, saturating.
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn server_times_parse() {
        let t = parse_time("2023-11-14T22:13:20.123Z").unwrap();
        assert_eq!(
            t.duration_since(UNIX_EPOCH).unwrap(),
            Duration::from_millis(1_700_000_000_123)
        );
    }

    #[test]
    fn ids_parse_from_strings_and_numbers() {
        #[derive(Deserialize)]
        struct T {
            #[serde(deserialize_with = "parse_u64")]
            a: u64,
            #[serde(deserialize_with = "parse_u64")]
            b: u64,
            #[serde(deserialize_with = "parse_opt_u64")]
            c: Option<u64>,
        }
        let t: T = serde_json::from_str(r#"{"a":"42","b":7,"c":null}"#).unwrap();
        assert_eq!((t.a, t.b, t.c), (42, 7, None));
    }
}
