//! The server's request decoder must never panic, whatever a client sends.
#![no_main]
use symmem::wire::store::{Limits, Request};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((_, used))) = Request::decode(rest, &Limits::SERVER) {
        rest = &rest[used..];
    }
});
