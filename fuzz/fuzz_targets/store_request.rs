//! The server's request framing and decoding must never panic, whatever a client sends, and
//! must agree: the framer finds a whole request exactly where the decoder does, however the
//! bytes arrive.
#![no_main]
use symmem::wire::store::{Framer, Limits, Request};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The first byte picks how the stream is cut into reads; the rest is the stream.
    let Some((&cut, data)) = data.split_first() else { return };
    let step = usize::from(cut % 17) + 1;
    let limits = Limits { max_message: 1 << 16, ..Limits::SERVER };
    let mut rest = data;
    loop {
        let want = Request::decode(rest, &limits).map(|r| r.map(|(_, n)| n));
        let mut framer = Framer::new();
        let mut got = Ok(None);
        let mut at = 0;
        while at < rest.len() {
            at = (at + step).min(rest.len());
            got = framer.advance(&rest[..at], &limits);
            if !matches!(got, Ok(None)) {
                break;
            }
        }
        assert_eq!(got, want, "framer and decoder disagree");
        match want {
            Ok(Some(n)) => rest = &rest[n..],
            _ => break,
        }
    }
});
