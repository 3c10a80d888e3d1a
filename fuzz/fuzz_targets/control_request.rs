//! The control socket's lines: a `Request` (what a local client sends the
//! daemon) or a `Response` (what the client reads back) from any bytes.
//! Never panics; whatever parses survives a trip through the encoder
//! unchanged, as the other end will read it.
#![no_main]

use lb_user::control::{Request, Response};
use libfuzzer_sys::fuzz_target;
use serde::{Serialize, de::DeserializeOwned};

fuzz_target!(|line: &[u8]| {
    round_trips::<Request>(line);
    round_trips::<Response>(line);
});

fn round_trips<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(line: &[u8]) {
    let Ok(value) = serde_json::from_slice::<T>(line) else { return };
    let encoded = serde_json::to_string(&value).expect("a parsed value encodes");
    let decoded: T =
        serde_json::from_str(&encoded).unwrap_or_else(|e| panic!("{encoded} does not decode: {e}"));
    assert_eq!(decoded, value, "{encoded}");
}
