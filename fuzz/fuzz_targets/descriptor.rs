//! Descriptor decoding must never panic, whatever a peer sends.
#![no_main]
use symmem::transport::RemoteBuffer;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(d) = RemoteBuffer::deserialize(data) {
        // Whatever decodes re-encodes to something that decodes to the same descriptor.
        assert_eq!(RemoteBuffer::deserialize(&d.serialize()).ok(), Some(d));
    }
});
