//! A reload's parse ([`Source::reread`], which parses only the service
//! tables whose text changed) against the whole parse, on any pair of
//! texts: the input is the old text, a NUL, and the new one. Whenever the
//! old text is a valid config, the reload reads the new text exactly as
//! parsing it whole does: the same config, or an error for both.
#![no_main]

use std::path::Path;

use lb_user::config::{Service, Source};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &str| {
    let Some((old, new)) = input.split_once('\0') else { return };
    let path = Path::new("fuzz.toml");
    let Ok((config, source)) = Source::parse(old.to_owned(), path) else { return };
    let running: Vec<&Service> = config.services.iter().collect();
    let reread = source.reread(new.to_owned(), path, &config.daemon, &running);
    match (reread, Source::parse(new.to_owned(), path)) {
        (Ok((reread, reread_source, _)), Ok((whole, whole_source))) => {
            assert_eq!(reread, whole, "the reload read another config than the whole parse");
            assert_eq!(reread_source, whole_source, "the reload kept other table starts");
        }
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => panic!("the reload accepted a text the whole parse rejects: {e}"),
        (Err(e), Ok(_)) => panic!("the reload rejected a text the whole parse accepts: {e}"),
    }
});
