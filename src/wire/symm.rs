//! What a rank publishes in the store when it rendezvouses a symmetric allocation.
//!
//! JSON, decoded strictly: unknown or missing fields are refused, so ranks running different
//! symmem versions fail with a clear error instead of misreading each other.

use serde::{Deserialize, Serialize};

/// The version of [`PeerRecord`]; a peer with another version is refused.
pub const RECORD_VERSION: u32 = 1;

/// One rank's description of its allocation, and where peers can open it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// The host, as `hostname/boot_id`: ranks with the same value share memory.
    pub host: String,
    /// The owner's process id.
    pub pid: u32,
    /// The owner's descriptor of the shared-memory file.
    pub fd: i32,
    /// The whole segment's size in bytes.
    pub segment_len: u64,
    /// The signal pad's size in bytes.
    pub pad_size: u64,
    /// The data buffer's size in bytes.
    pub buffer_size: u64,
    /// The shape of the tensor being rendezvoused.
    pub shape: Vec<u64>,
    /// Its dtype, as [`crate::tensor::DType::code`].
    pub dtype: u8,
    /// Its byte offset in the allocation's data buffer.
    pub offset: u64,
}

impl PeerRecord {
    /// The JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing a struct of integers and strings cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses and checks the version.
    pub fn decode(bytes: &[u8]) -> Result<PeerRecord, String> {
        let r: PeerRecord = serde_json::from_slice(bytes).map_err(|e| format!("malformed rendezvous record: {e}"))?;
        if r.version != RECORD_VERSION {
            return Err(format!("rendezvous record version {} (this symmem speaks {RECORD_VERSION})", r.version));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_strangers() {
        let r = PeerRecord {
            version: 1,
            host: "h/b".into(),
            pid: 7,
            fd: 9,
            segment_len: 4096,
            pad_size: 9216,
            buffer_size: 64,
            shape: vec![4, 4],
            dtype: 1,
            offset: 0,
        };
        assert_eq!(PeerRecord::decode(&r.encode()), Ok(r.clone()));
        let mut v: serde_json::Value = serde_json::from_slice(&r.encode()).unwrap();
        v["extra"] = 1.into();
        assert!(PeerRecord::decode(v.to_string().as_bytes()).unwrap_err().contains("unknown field"));
        assert!(PeerRecord::decode(b"{").is_err());
        let old = PeerRecord { version: 2, ..r };
        assert!(PeerRecord::decode(&old.encode()).unwrap_err().contains("version 2"));
    }
}
