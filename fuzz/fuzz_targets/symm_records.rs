//! What ranks publish at rendezvous (records, and the blob a gathering rank 0 publishes) must
//! never make a reader panic or allocate without bound, whatever a peer (or the store) says.
#![no_main]
use symmem::wire::symm::{PeerRecord, pack_gathered, unpack_gathered};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(r) = PeerRecord::decode(data) {
        assert_eq!(PeerRecord::decode(&r.encode()), Ok(r));
    }
    let Some((&count, blob)) = data.split_first() else { return };
    if let Ok(values) = unpack_gathered(blob, usize::from(count)) {
        assert_eq!(unpack_gathered(&pack_gathered(&values), values.len()), Ok(values));
    }
    // A deflated blob built from the input: inflation is bounded and every value comes back.
    let values: Vec<Vec<u8>> = data.chunks(7).map(<[u8]>::to_vec).collect();
    assert_eq!(unpack_gathered(&pack_gathered(&values), values.len()), Ok(values));
});
