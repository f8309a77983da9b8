//! The tcp transport's handshake messages and frame headers must never panic, whatever a peer
//! sends, and whatever decodes re-encodes to the same bytes' meaning.
#![no_main]
use symmem::wire::tcp::{CHALLENGE_LEN, Challenge, HEADER_LEN, HELLO_LEN, Header, Hello};

fn array<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    for (x, y) in a.iter_mut().zip(data) {
        *x = *y;
    }
    a
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let h: [u8; HEADER_LEN] = array(data);
    if let Ok(d) = Header::decode(&h) {
        assert_eq!(Header::decode(&d.encode()), Ok(d));
    }
    let hello: [u8; HELLO_LEN] = array(data);
    if let Ok(d) = Hello::decode(&hello) {
        assert_eq!(Hello::decode(&d.encode()), Ok(d));
    }
    let c: [u8; CHALLENGE_LEN] = array(data);
    if let Ok(d) = Challenge::decode(&c) {
        assert_eq!(Challenge::decode(&d.encode()), Ok(d));
    }
});
