//! `Envelope::from_json`: the job record as the store keeps it (the
//! `envelope` column), read back on every transition.
//!
//! Properties: never a panic; whatever reads as an envelope writes back to
//! JSON that reads as the same envelope (`to_json` is lossless), and
//! writing that again gives the same text.
#![no_main]

use lazaret_core::Envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(envelope) = Envelope::from_json(text) else {
        return;
    };
    let json = envelope.to_json();
    let back = Envelope::from_json(&json)
        .unwrap_or_else(|e| panic!("to_json wrote what from_json refuses: {e}\n{json}"));
    assert_eq!(back, envelope, "decode(encode(x)) != x via {json}");
    assert_eq!(back.to_json(), json, "encoding is not stable");
});
