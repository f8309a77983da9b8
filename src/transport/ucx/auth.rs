//! The `ucx` backend's authentication, with the job's secret: a handshake that proves the
//! secret both ways, then a tag on every active message, under keys of the connection.
//!
//! ```text
//!   initiator                                         owner
//!   PING      [t, origin] | client nonce (32)  ──▶    refuses its own origin (a reflection)
//!   CHALLENGE [t, OK, owner's origin]          ◀──    | server nonce (32) | server proof (32)
//!   AUTH      [t, origin] | client proof (32)  ──▶
//!   DONE      [t, OK] | tag                    ◀──    the origin's requests are served from now
//! ```
//!
//! The proofs are HMAC-SHA256 of the secret over the [`transcript`] (both origins, both
//! nonces), each under its own side's label, so a proof is good for one connection and one
//! side only. Both ends then derive two keys from the secret and the transcript (HKDF-SHA256,
//! `wire::seal::expand`), one per direction, and every message after carries a tag: an
//! HMAC-SHA256 of its id, its header (a request's holds its endpoint's sequence number, which
//! the owner's order machinery takes once) and its bytes when they travel in the message
//! (eagerly, up to 64 KiB). The owner checks a request's tag before it is parked or run, and
//! an initiator an answer's before it completes anything: an injected, replayed or changed
//! message ends that endpoint's session (the owner forgets its keys and order; the initiator
//! fails everything pending) with the reason.
//!
//! What the tags do not cover: bytes a large message moves by UCX's rendezvous (RDMA reads on
//! a fabric, UCX's own fragments over its tcp), whose integrity is the fabric's, as for NCCL
//! and MPI; the header that announces them, their length and destination included, is
//! covered. Nothing is encrypted.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::store::Secret;
use crate::wire::seal::Side;

/// Bytes of a nonce of the handshake.
pub(super) const NONCE_LEN: usize = 32;
/// Bytes of a proof of the secret.
pub(super) const PROOF_LEN: usize = 32;
/// Bytes of a message's tag.
pub(super) const TAG_LEN: usize = 32;

const SERVER_PROOF: &[u8] = b"symmem-ucx-v1 server proof";
const CLIENT_PROOF: &[u8] = b"symmem-ucx-v1 client proof";
const MESSAGE_KEYS: &[u8] = b"symmem-ucx-v1 message keys";

/// What the proofs and the keys of one connection cover: the initiator's endpoint (its origin)
/// and nonce, the owner's endpoint and nonce.
pub(super) fn transcript(
    client_origin: u64,
    client_nonce: &[u8; NONCE_LEN],
    server_origin: u64,
    server_nonce: &[u8; NONCE_LEN],
) -> Vec<u8> {
    let mut t = Vec::with_capacity(2 * (8 + NONCE_LEN));
    t.extend_from_slice(&client_origin.to_le_bytes());
    t.extend_from_slice(client_nonce);
    t.extend_from_slice(&server_origin.to_le_bytes());
    t.extend_from_slice(server_nonce);
    t
}

/// The owner's proof of the secret on the connection of `transcript`.
pub(super) fn server_proof(secret: &Secret, transcript: &[u8]) -> [u8; PROOF_LEN] {
    secret.sign(SERVER_PROOF, &[transcript])
}

/// Whether `proof` is the owner's, made with the secret, on the connection of `transcript`.
pub(super) fn check_server_proof(secret: &Secret, transcript: &[u8], proof: &[u8]) -> bool {
    secret.check(SERVER_PROOF, &[transcript], proof)
}

/// The initiator's proof of the secret on the connection of `transcript`.
pub(super) fn client_proof(secret: &Secret, transcript: &[u8]) -> [u8; PROOF_LEN] {
    secret.sign(CLIENT_PROOF, &[transcript])
}

/// Whether `proof` is the initiator's, made with the secret, on the connection of `transcript`.
pub(super) fn check_client_proof(secret: &Secret, transcript: &[u8], proof: &[u8]) -> bool {
    secret.check(CLIENT_PROOF, &[transcript], proof)
}

/// 32 fresh random bytes.
pub(super) fn nonce() -> std::result::Result<[u8; NONCE_LEN], String> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| format!("draw a nonce: {e}"))?;
    Ok(n)
}

/// The message keys of one connection, as one of its ends sees them.
#[derive(Clone)]
pub(super) struct Keys {
    /// Tags what this end sends.
    mine: Hmac<Sha256>,
    /// Checks what it receives.
    theirs: Hmac<Sha256>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

impl Keys {
    /// The keys of the connection of `transcript`, for `side` (the initiator is the client).
    pub(super) fn derive(secret: &Secret, transcript: &[u8], side: Side) -> Keys {
        let mut both = [0u8; 64];
        secret.expand(MESSAGE_KEYS, transcript, &mut both);
        let (to_owner, to_initiator) = both.split_at(32);
        // HMAC takes keys of any length: these cannot fail.
        let key = |k: &[u8]| <Hmac<Sha256> as KeyInit>::new_from_slice(k).expect("hmac accepts any key length");
        let (mine, theirs) = match side {
            Side::Client => (key(to_owner), key(to_initiator)),
            Side::Server => (key(to_initiator), key(to_owner)),
        };
        Keys { mine, theirs }
    }

    /// The tag of a message this end sends: message `id`, `header` (without its tag) and the
    /// bytes it carries (none when they go by rendezvous).
    pub(super) fn tag(&self, id: u32, header: &[u8], data: &[u8]) -> [u8; TAG_LEN] {
        let mut m = self.mine.clone();
        feed(&mut m, id, header, data);
        m.finalize().into_bytes().into()
    }

    /// Whether `tag` is that of a message the other end sent (in constant time).
    pub(super) fn check(&self, id: u32, header: &[u8], data: &[u8], tag: &[u8]) -> bool {
        let mut m = self.theirs.clone();
        feed(&mut m, id, header, data);
        m.verify_slice(tag).is_ok()
    }
}

fn feed(m: &mut Hmac<Sha256>, id: u32, header: &[u8], data: &[u8]) {
    m.update(&id.to_le_bytes());
    m.update(&(header.len() as u64).to_le_bytes());
    m.update(header);
    m.update(&(data.len() as u64).to_le_bytes());
    m.update(data);
}

/// A tagged header split into the header and its tag; `None` if it is too short to carry one.
pub(super) fn split(h: &[u8]) -> Option<(&[u8], &[u8])> {
    h.len().checked_sub(TAG_LEN).map(|at| h.split_at(at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_bind_the_direction_the_connection_and_every_byte() {
        let s = Secret::new("job").unwrap();
        let t = transcript(1, &[2; 32], 3, &[4; 32]);
        let (c, o) = (Keys::derive(&s, &t, Side::Client), Keys::derive(&s, &t, Side::Server));
        let tag = c.tag(7, b"header", b"data");
        assert!(o.check(7, b"header", b"data", &tag));
        // Another id, header, data, split between them, direction, connection or secret: no.
        assert!(!o.check(8, b"header", b"data", &tag));
        assert!(!o.check(7, b"headeR", b"data", &tag));
        assert!(!o.check(7, b"header", b"datA", &tag));
        assert!(!o.check(7, b"head", b"erdata", &tag));
        assert!(!c.check(7, b"header", b"data", &tag), "a tag reflected to its sender");
        let other = Keys::derive(&s, &transcript(1, &[2; 32], 3, &[5; 32]), Side::Server);
        assert!(!other.check(7, b"header", b"data", &tag));
        let other = Keys::derive(&Secret::new("other").unwrap(), &t, Side::Server);
        assert!(!other.check(7, b"header", b"data", &tag));
        // Proofs are their side's alone.
        let p = server_proof(&s, &t);
        assert!(check_server_proof(&s, &t, &p) && !check_client_proof(&s, &t, &p));
        assert_ne!(server_proof(&s, &t), client_proof(&s, &t));
        assert!(split(&[0; 31]).is_none());
        assert_eq!(split(&[1; 40]).map(|(h, t)| (h.len(), t.len())), Some((8, 32)));
    }
}
