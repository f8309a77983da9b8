//! The client's reply decoder must never panic, whatever a server sends.
#![no_main]
use symmem::wire::store::{Limits, Reply, ReplyShape};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let shapes = [
        ReplyShape::U8,
        ReplyShape::I64,
        ReplyShape::U32,
        ReplyShape::Bytes,
        ReplyShape::Values(4),
        ReplyShape::Keys,
        ReplyShape::QueuePop,
        ReplyShape::AuthChallenge,
    ];
    let Some((&pick, rest)) = data.split_first() else { return };
    let _ = Reply::decode(shapes[pick as usize % shapes.len()], rest, &Limits::CLIENT);
});
