//! What a rank publishes in the store when it rendezvouses a symmetric allocation.
//!
//! JSON, decoded strictly: unknown or missing fields are refused, so ranks running different
//! symmem versions fail with a clear error instead of misreading each other.

use serde::{Deserialize, Serialize};

/// The version of [`PeerRecord`]; a peer with another version is refused.
pub const RECORD_VERSION: u32 = 2;

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
    /// The CPUs the owner may run on (its affinity mask), as inclusive ranges: with its
    /// host's other ranks', whether they outnumber the CPUs they share.
    pub cpus: Vec<[u32; 2]>,
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

/// The largest unpacked gathered blob accepted (bounds what a damaged blob can make us allocate).
pub const MAX_GATHERED: usize = 1 << 30;

/// Packs the values of an all-gather into one blob, as the root of a gathered rendezvous
/// publishes them: `D` and then, deflated, a little-endian `u32` count and per value a `u32`
/// length and its bytes. Rendezvous records repeat themselves (hosts, shapes, sizes), so the
/// blob every rank downloads shrinks about tenfold.
pub fn pack_gathered(values: &[Vec<u8>]) -> Vec<u8> {
    use std::io::Write;
    let mut raw = Vec::with_capacity(4 + values.iter().map(|v| v.len() + 4).sum::<usize>());
    raw.extend_from_slice(&(values.len() as u32).to_le_bytes());
    for v in values {
        raw.extend_from_slice(&(v.len() as u32).to_le_bytes());
        raw.extend_from_slice(v);
    }
    let mut z = flate2::write::DeflateEncoder::new(vec![b'D'], flate2::Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = z.write_all(&raw);
    z.finish().unwrap_or_default()
}

/// Unpacks [`pack_gathered`]'s blob, which must hold exactly `count` values.
pub fn unpack_gathered(blob: &[u8], count: usize) -> Result<Vec<Vec<u8>>, String> {
    use std::io::Read;
    fn take<'a>(blob: &'a [u8], at: &mut usize, len: usize) -> Result<&'a [u8], String> {
        let end = at.checked_add(len).filter(|&e| e <= blob.len()).ok_or("truncated gathered blob")?;
        let b = &blob[*at..end];
        *at = end;
        Ok(b)
    }
    fn word(blob: &[u8], at: &mut usize) -> Result<usize, String> {
        let b = take(blob, at, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    let Some((&b'D', packed)) = blob.split_first() else {
        return Err("not a gathered blob".into());
    };
    let mut raw = Vec::new();
    flate2::read::DeflateDecoder::new(packed)
        .take(MAX_GATHERED as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| format!("gathered blob does not inflate: {e}"))?;
    if raw.len() > MAX_GATHERED {
        return Err(format!("gathered blob inflates past {MAX_GATHERED} bytes"));
    }
    let blob = &raw[..];
    let mut at = 0;
    let n = word(blob, &mut at)?;
    if n != count {
        return Err(format!("gathered blob holds {n} values; expected {count}"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = word(blob, &mut at)?;
        out.push(take(blob, &mut at, len)?.to_vec());
    }
    if at != blob.len() {
        return Err("trailing bytes after the gathered values".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_blobs_round_trip_and_reject_damage() {
        let values = vec![b"a".to_vec(), Vec::new(), vec![7; 300]];
        let blob = pack_gathered(&values);
        assert_eq!(unpack_gathered(&blob, 3), Ok(values));
        assert!(unpack_gathered(&blob, 2).unwrap_err().contains("expected 2"));
        assert!(unpack_gathered(&blob[..blob.len() - 1], 3).is_err());
        assert!(unpack_gathered(b"", 3).is_err() && unpack_gathered(b"Dxyz", 3).is_err());
        for cut in 0..blob.len() {
            let _ = unpack_gathered(&blob[..cut], 3);
        }
        let mut flipped = blob.clone();
        for i in 1..flipped.len() {
            flipped[i] ^= 0x5a;
            let _ = unpack_gathered(&flipped, 3);
            flipped[i] ^= 0x5a;
        }
        // Repetitive records shrink.
        let records: Vec<Vec<u8>> =
            (0..256).map(|r| format!("host node{}/boot-id, shape [512, 512], rank {r}", r / 8).into_bytes()).collect();
        let packed = pack_gathered(&records);
        assert!(packed.len() * 5 < records.iter().map(Vec::len).sum::<usize>(), "{} bytes", packed.len());
        assert_eq!(unpack_gathered(&packed, 256), Ok(records));
    }

    #[test]
    fn round_trips_and_refuses_strangers() {
        let r = PeerRecord {
            version: RECORD_VERSION,
            host: "h/b".into(),
            pid: 7,
            fd: 9,
            segment_len: 4096,
            pad_size: 9216,
            buffer_size: 64,
            shape: vec![4, 4],
            dtype: 1,
            offset: 0,
            cpus: vec![[0, 3], [8, 8]],
        };
        assert_eq!(PeerRecord::decode(&r.encode()), Ok(r.clone()));
        let mut v: serde_json::Value = serde_json::from_slice(&r.encode()).unwrap();
        v["extra"] = 1.into();
        assert!(PeerRecord::decode(v.to_string().as_bytes()).unwrap_err().contains("unknown field"));
        assert!(PeerRecord::decode(b"{").is_err());
        let old = PeerRecord { version: 1, ..r };
        assert!(PeerRecord::decode(&old.encode()).unwrap_err().contains("version 1"));
    }
}
