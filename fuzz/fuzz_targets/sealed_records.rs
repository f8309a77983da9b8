//! Sealed records (`wire::seal`), the bytes a peer or anyone on the path sends after a link's
//! handshake: opening never panics whatever arrives, as records or as a stream, and only what
//! a sealer made opens, to the bytes it sealed.
#![no_main]
use symmem::wire::seal::{Side, derive};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let t = b"fuzzed transcript";
    let mut server = derive(b"secret", b"fuzz", t, Side::Server);
    // Arbitrary bytes as a record and as a stream: refused (a forgery opens with negligible
    // chance), never a panic.
    let mut record = data.to_vec();
    let _ = server.opener.open_in_place(&mut record);
    let mut raw = data.to_vec();
    let _ = server.opener.open_stream(&mut raw, &mut Vec::new());
    // What a sealer made opens to the same bytes, in order, split anywhere.
    let mut c2 = derive(b"secret", b"fuzz", t, Side::Client);
    let mut s2 = derive(b"secret", b"fuzz", t, Side::Server);
    let mut wire = Vec::new();
    c2.sealer.seal_stream(&mut wire, data).unwrap();
    let cut = data.first().map_or(0, |&b| b as usize).min(wire.len());
    let (mut raw, mut plain) = (wire[..cut].to_vec(), Vec::new());
    s2.opener.open_stream(&mut raw, &mut plain).unwrap();
    raw.extend_from_slice(&wire[cut..]);
    s2.opener.open_stream(&mut raw, &mut plain).unwrap();
    assert_eq!(plain, data);
    assert!(raw.is_empty());
});
