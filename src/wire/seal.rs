//! Sealed records: what protects the bytes of a link after its handshake, when both ends hold
//! the job's secret.
//!
//! Each direction of a connection has its own AES-128-GCM key, derived with HKDF-SHA256 from
//! the job's secret and the handshake's transcript (both endpoints' tokens, the flow, both
//! fresh nonces, the mode), so the keys of one connection are worthless on any other, and a
//! relay or a reflection that carried the handshake through cannot produce a single record.
//! Every record is `ciphertext | tag (16)`, its nonce the direction's record counter: a
//! record injected, altered, replayed, dropped, reordered or cut off fails to open, and the
//! connection ends before its bytes are used. Keys are replaced every [`REKEY_EVERY`] records
//! (each side derives the next one from the last: no message).
//!
//! A record carries at most [`RECORD_MAX`] bytes, so a receiver opens a payload one record
//! at a time in a small buffer and copies only authenticated bytes to their destination.
//!
//! The construction is the TLS 1.3 / Noise transport pattern: an AEAD with a per-direction key
//! and an implicit sequence number (RFC 8446 §5.3), the keys from HKDF (RFC 5869).

use ring::aead::{AES_128_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, Tag, UnboundKey};
use ring::hkdf;

/// Bytes a record adds to what it carries.
pub const TAG_LEN: usize = 16;
/// The most bytes one record carries.
pub const RECORD_MAX: usize = 256 * 1024;
/// Records under one key before both sides move to the next: at most 2^38 bytes (2^34 AES
/// blocks) per key, which keeps AES-GCM's distinguishing bound (blocks^2 / 2^128) under
/// 2^-60, TLS 1.3's target (RFC 8446 §5.5).
pub const REKEY_EVERY: u64 = 1 << 20;

const KEY_LEN: usize = 16;

/// Why a record cannot be sealed or opened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The record is not the peer's: altered, injected, replayed, reordered or cut.
    #[error(
        "a record failed authentication: it was altered, injected, replayed, reordered or cut off on the way \
         (someone between the two ends, or not the job's peer)"
    )]
    Forged,
    /// A record longer than [`RECORD_MAX`] was asked for.
    #[error("a record of {0} bytes exceeds the {RECORD_MAX}-byte limit")]
    TooLong(usize),
    /// Shorter than a tag.
    #[error("a record of {0} bytes is shorter than its {TAG_LEN}-byte tag")]
    TooShort(usize),
}

/// Which end of a connection derives keys: the client seals with the first key and opens
/// with the second, the server the other way round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The end that connected.
    Client,
    /// The end that accepted.
    Server,
}

/// One direction's key and record counter.
struct Direction {
    key: LessSafeKey,
    raw: [u8; KEY_LEN],
    seq: u64,
}

impl Direction {
    fn new(raw: [u8; KEY_LEN]) -> Direction {
        Direction { key: aes_key(&raw), raw, seq: 0 }
    }

    /// The nonce of the next record (its counter), moving to the next key at an epoch's end.
    fn next_nonce(&mut self) -> Nonce {
        if self.seq != 0 && self.seq.is_multiple_of(REKEY_EVERY) {
            self.raw = expand(&self.raw, &[b"symmem link rekey"]);
            self.key = aes_key(&self.raw);
        }
        let mut n = [0u8; NONCE_LEN];
        n[NONCE_LEN - 8..].copy_from_slice(&self.seq.to_be_bytes());
        // A counter of 2^64 records is out of reach (at a record a nanosecond, 584 years);
        // wrapping would repeat a nonce, so it saturates and the next open fails instead.
        self.seq = self.seq.saturating_add(1);
        Nonce::assume_unique_for_key(n)
    }
}

fn aes_key(raw: &[u8; KEY_LEN]) -> LessSafeKey {
    // AES-128 takes any 16 bytes: `new` fails only for a wrong length, which the type rules out.
    LessSafeKey::new(UnboundKey::new(&AES_128_GCM, raw).expect("a 16-byte AES-128 key"))
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand of `prk` with `info`, 16 bytes.
fn expand(prk: &[u8], info: &[&[u8]]) -> [u8; KEY_LEN] {
    let mut out = [0u8; KEY_LEN];
    // 16 bytes are far below HKDF-SHA256's 255 * 32-byte limit: neither step can fail.
    hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, prk)
        .expand(info, Len(KEY_LEN))
        .and_then(|okm| okm.fill(&mut out))
        .expect("16 bytes of HKDF-SHA256 output");
    out
}

/// Fills `out` with key material for one connection: HKDF-SHA256 with the secret as input key
/// material, `label` naming the protocol and the use (so keys of one are never another's) and
/// `transcript` the handshake both ends saw (so they are this connection's alone). Panics past
/// HKDF-SHA256's limit (8160 bytes); symmem's callers ask for 32 or 64.
pub(crate) fn expand_secret(secret: &[u8], label: &[u8], transcript: &[u8], out: &mut [u8]) {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"symmem link keys v1").extract(secret);
    // Up to 255 * 32 bytes is within HKDF-SHA256's limit (see above).
    prk.expand(&[label, transcript], Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("at most 8160 bytes of HKDF-SHA256 output");
}

/// Seals the records one end sends.
pub struct Sealer(Direction);

/// Opens the records one end receives, in order.
pub struct Opener(Direction);

/// The record protection of one connection, as one of its ends sees it.
pub struct Keys {
    /// For what this end sends.
    pub sealer: Sealer,
    /// For what this end receives.
    pub opener: Opener,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

/// The keys of one connection for `side`: HKDF-SHA256 with the secret as input key material,
/// `label` naming the protocol (so keys of one protocol are never another's) and `transcript`
/// the handshake that both ends saw (so they are this connection's alone).
pub fn derive(secret: &[u8], label: &[u8], transcript: &[u8], side: Side) -> Keys {
    let mut both = [0u8; 2 * KEY_LEN];
    expand_secret(secret, label, transcript, &mut both);
    let (to_server, to_client) = both.split_at(KEY_LEN);
    let (c2s, s2c) = (to_server.try_into().unwrap_or([0; KEY_LEN]), to_client.try_into().unwrap_or([0; KEY_LEN]));
    let (mine, theirs) = match side {
        Side::Client => (c2s, s2c),
        Side::Server => (s2c, c2s),
    };
    Keys { sealer: Sealer(Direction::new(mine)), opener: Opener(Direction::new(theirs)) }
}

impl Sealer {
    /// Appends the record of `plaintext` (at most [`RECORD_MAX`] bytes) to `out`.
    pub fn seal_into(&mut self, out: &mut Vec<u8>, plaintext: &[u8]) -> Result<(), SealError> {
        if plaintext.len() > RECORD_MAX {
            return Err(SealError::TooLong(plaintext.len()));
        }
        let at = out.len();
        out.reserve(plaintext.len() + TAG_LEN);
        out.extend_from_slice(plaintext);
        let tag = self.seal_in_place(&mut out[at..])?;
        out.extend_from_slice(&tag);
        Ok(())
    }

    /// Encrypts `buf` (at most [`RECORD_MAX`] bytes) in place; its tag, which follows it on
    /// the wire.
    pub fn seal_in_place(&mut self, buf: &mut [u8]) -> Result<[u8; TAG_LEN], SealError> {
        self.seal_with(&[], buf)
    }

    /// [`Sealer::seal_in_place`], the tag also covering `aad` (bytes sent in the clear).
    fn seal_with(&mut self, aad: &[u8], buf: &mut [u8]) -> Result<[u8; TAG_LEN], SealError> {
        if buf.len() > RECORD_MAX {
            return Err(SealError::TooLong(buf.len()));
        }
        let nonce = self.0.next_nonce();
        let tag: Tag =
            self.0.key.seal_in_place_separate_tag(nonce, Aad::from(aad), buf).map_err(|_| SealError::Forged)?;
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(tag.as_ref());
        Ok(t)
    }

    /// Appends `plaintext` to `out` as a sealed stream: records of at most [`RECORD_MAX`]
    /// bytes, each `length u32 (little-endian, in the clear, authenticated) | ciphertext | tag`,
    /// for protocols whose messages do not announce their length in a fixed header (the
    /// store's). Nothing is appended for no bytes.
    pub fn seal_stream(&mut self, out: &mut Vec<u8>, plaintext: &[u8]) -> Result<(), SealError> {
        for part in plaintext.chunks(RECORD_MAX) {
            // A part is at most RECORD_MAX (256 KiB) long: its length fits a u32.
            let len = (part.len() as u32).to_le_bytes();
            out.extend_from_slice(&len);
            let at = out.len();
            out.extend_from_slice(part);
            let tag = self.seal_with(&len, &mut out[at..])?;
            out.extend_from_slice(&tag);
        }
        Ok(())
    }
}

impl Opener {
    /// Opens the next record, `record` being its ciphertext and tag, in place; the plaintext
    /// (the record's first `len - TAG_LEN` bytes). On failure the record's bytes are left
    /// undefined and the link must end: every later record would fail too.
    pub fn open_in_place<'a>(&mut self, record: &'a mut [u8]) -> Result<&'a mut [u8], SealError> {
        let n = record.len();
        if n < TAG_LEN {
            return Err(SealError::TooShort(n));
        }
        if n - TAG_LEN > RECORD_MAX {
            return Err(SealError::TooLong(n - TAG_LEN));
        }
        let nonce = self.0.next_nonce();
        self.0.key.open_in_place(nonce, Aad::empty(), record).map_err(|_| SealError::Forged)
    }

    /// Opens the whole records at the front of `raw`, a sealed stream
    /// ([`Sealer::seal_stream`]), appending their bytes to `plain` and removing them from
    /// `raw` (a record still arriving stays); how many bytes were appended.
    pub fn open_stream(&mut self, raw: &mut Vec<u8>, plain: &mut Vec<u8>) -> Result<usize, SealError> {
        let (mut at, before) = (0, plain.len());
        while let Some(len) = raw.get(at..at + 4) {
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            if len > RECORD_MAX {
                return Err(SealError::TooLong(len));
            }
            let end = at + 4 + len + TAG_LEN;
            if raw.len() < end {
                break;
            }
            let (head, rest) = raw.split_at_mut(at + 4);
            let nonce = self.0.next_nonce();
            let bytes = self
                .0
                .key
                .open_in_place(nonce, Aad::from(&head[at..]), &mut rest[..len + TAG_LEN])
                .map_err(|_| SealError::Forged)?;
            plain.extend_from_slice(bytes);
            at = end;
        }
        raw.drain(..at);
        Ok(plain.len() - before)
    }
}

/// The length on the wire of `len` bytes sealed in records of at most [`RECORD_MAX`] (a
/// payload of 0 bytes is no record at all); `None` past `u64`.
pub fn sealed_len(len: u64) -> Option<u64> {
    let records = len.div_ceil(RECORD_MAX as u64);
    len.checked_add(records.checked_mul(TAG_LEN as u64)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pair() -> (Keys, Keys) {
        let t = b"transcript";
        (derive(b"secret", b"test", t, Side::Client), derive(b"secret", b"test", t, Side::Server))
    }

    #[test]
    fn records_open_in_order_only_under_the_right_keys() {
        let (mut c, mut s) = pair();
        let mut wire = Vec::new();
        for msg in [&b"one"[..], b"", &[7u8; RECORD_MAX]] {
            wire.clear();
            c.sealer.seal_into(&mut wire, msg).unwrap();
            assert_eq!(wire.len(), msg.len() + TAG_LEN);
            if !msg.is_empty() {
                assert_ne!(&wire[..msg.len()], msg, "sealed bytes are not the plaintext");
            }
            assert_eq!(s.opener.open_in_place(&mut wire).unwrap(), msg);
        }
        // The other direction has its own key: a client's record does not open as a server's.
        let mut r = Vec::new();
        c.sealer.seal_into(&mut r, b"x").unwrap();
        let mut r2 = r.clone();
        assert_eq!(c.opener.open_in_place(&mut r2), Err(SealError::Forged), "reflected back to its sender");
        // Another connection's keys (another transcript, or secret) open nothing.
        let mut other = derive(b"secret", b"test", b"transcript2", Side::Server);
        assert_eq!(other.opener.open_in_place(&mut r.clone()), Err(SealError::Forged));
        let mut other = derive(b"secret2", b"test", b"transcript", Side::Server);
        assert_eq!(other.opener.open_in_place(&mut r.clone()), Err(SealError::Forged));
        let mut other = derive(b"secret", b"test2", b"transcript", Side::Server);
        assert_eq!(other.opener.open_in_place(&mut r.clone()), Err(SealError::Forged));
        assert!(s.opener.open_in_place(&mut r).is_ok());
    }

    #[test]
    fn replayed_reordered_dropped_and_cut_records_fail() {
        let (mut c, mut s) = pair();
        let rec = |c: &mut Keys, m: &[u8]| {
            let mut w = Vec::new();
            c.sealer.seal_into(&mut w, m).unwrap();
            w
        };
        let (a, b) = (rec(&mut c, b"first"), rec(&mut c, b"second"));
        // Reordered: the second first.
        let (mut c2, mut s2) = pair();
        let (a2, b2) = (rec(&mut c2, b"first"), rec(&mut c2, b"second"));
        assert_eq!(s2.opener.open_in_place(&mut b2.clone()), Err(SealError::Forged));
        drop(a2);
        // In order: fine; then a replay of the first fails.
        assert!(s.opener.open_in_place(&mut a.clone()).is_ok());
        assert!(s.opener.open_in_place(&mut b.clone()).is_ok());
        assert_eq!(s.opener.open_in_place(&mut a.clone()), Err(SealError::Forged), "replayed");
        // Dropped: the third opened where the next was expected.
        let (mut c3, mut s3) = pair();
        let _lost = rec(&mut c3, b"lost");
        assert_eq!(s3.opener.open_in_place(&mut rec(&mut c3, b"next")), Err(SealError::Forged));
        // Cut: a record without its last byte, and one shorter than a tag.
        let (mut c4, mut s4) = pair();
        let mut r = rec(&mut c4, b"whole");
        r.pop();
        assert_eq!(s4.opener.open_in_place(&mut r), Err(SealError::Forged));
        assert_eq!(s4.opener.open_in_place(&mut [0u8; 3]), Err(SealError::TooShort(3)));
        // Too long, either way.
        assert_eq!(
            c4.sealer.seal_into(&mut Vec::new(), &vec![0; RECORD_MAX + 1]),
            Err(SealError::TooLong(RECORD_MAX + 1))
        );
    }

    #[test]
    fn keys_move_on_together_at_an_epochs_end() {
        let (mut c, mut s) = pair();
        // Jump both counters to just before the change of key.
        c.sealer.0.seq = REKEY_EVERY - 1;
        s.opener.0.seq = REKEY_EVERY - 1;
        let before = c.sealer.0.raw;
        for i in 0..3u8 {
            let mut w = Vec::new();
            c.sealer.seal_into(&mut w, &[i; 10]).unwrap();
            assert_eq!(s.opener.open_in_place(&mut w).unwrap(), &[i; 10]);
        }
        assert_ne!(c.sealer.0.raw, before, "the key changed");
        assert_eq!(c.sealer.0.raw, s.opener.0.raw);
    }

    #[test]
    fn a_sealed_stream_opens_whatever_way_it_arrives_and_refuses_any_change() {
        let (mut c, mut s) = pair();
        let msg: Vec<u8> = (0..(2 * RECORD_MAX + 100)).map(|i| (i % 251) as u8).collect();
        let mut wire = Vec::new();
        c.sealer.seal_stream(&mut wire, &msg).unwrap();
        c.sealer.seal_stream(&mut wire, b"").unwrap();
        c.sealer.seal_stream(&mut wire, b"tail").unwrap();
        assert_eq!(wire.len(), msg.len() + 4 + 4 * (4 + TAG_LEN));
        // In parts of 1000 bytes: every record opens once whole, not before.
        let (mut raw, mut plain) = (Vec::new(), Vec::new());
        for part in wire.chunks(1000) {
            raw.extend_from_slice(part);
            s.opener.open_stream(&mut raw, &mut plain).unwrap();
        }
        assert!(raw.is_empty());
        assert_eq!(&plain[..msg.len()], &msg[..]);
        assert_eq!(&plain[msg.len()..], b"tail");
        // A changed byte anywhere past the length, or a length made smaller: refused. (A
        // length made larger waits for bytes that never come: the stream's end or its
        // timeout ends it.)
        for (at, bit) in [(0usize, 8u8), (10, 4), (4999, 128)] {
            let (mut c, mut s) = pair();
            let mut w = Vec::new();
            c.sealer.seal_stream(&mut w, &msg[..5000]).unwrap();
            w[at] ^= bit;
            assert_eq!(s.opener.open_stream(&mut w, &mut Vec::new()), Err(SealError::Forged), "byte {at}");
        }
        let mut huge = ((RECORD_MAX + 1) as u32).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 32]);
        assert_eq!(pair().1.opener.open_stream(&mut huge, &mut Vec::new()), Err(SealError::TooLong(RECORD_MAX + 1)));
    }

    #[test]
    fn sealed_lengths() {
        assert_eq!(sealed_len(0), Some(0));
        assert_eq!(sealed_len(1), Some(17));
        assert_eq!(sealed_len(RECORD_MAX as u64), Some(RECORD_MAX as u64 + 16));
        assert_eq!(sealed_len(RECORD_MAX as u64 + 1), Some(RECORD_MAX as u64 + 33));
        assert_eq!(sealed_len(u64::MAX), None);
    }

    proptest! {
        /// Any flipped bit of any record makes it fail.
        #[test]
        fn any_flipped_bit_is_refused(msg in proptest::collection::vec(any::<u8>(), 0..300), bit in any::<usize>()) {
            let (mut c, mut s) = pair();
            let mut w = Vec::new();
            c.sealer.seal_into(&mut w, &msg).unwrap();
            let bit = bit % (w.len() * 8);
            w[bit / 8] ^= 1 << (bit % 8);
            prop_assert_eq!(s.opener.open_in_place(&mut w), Err(SealError::Forged));
        }

        #[test]
        fn opening_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let (_, mut s) = pair();
            let mut b = bytes;
            let _ = s.opener.open_in_place(&mut b);
        }
    }
}
