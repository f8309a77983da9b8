//! The `tcp` transport's wire format: a handshake per flow, then fixed 64-byte frame headers,
//! little-endian, followed by the payload the header announces.
//!
//! ```text
//!   hello      client → server   magic "SYMTCP04" | server token (16) | client token (16)
//!                                | flow index u32 | flow count u32 | auth u8 | frames u8 | 0 (6)
//!                                | client nonce (32)                          (88 bytes)
//!   challenge  server → client   status u8 | auth u8 | frames u8 | 0 (5) | server nonce (32)
//!                                | server proof (32)                          (72 bytes)
//!   proof      client → server   client proof (32)                            (32 bytes)
//!   verdict    server → client   status u8: 0 accepted, else refused         (1 byte)
//!
//!   header     op u8 | status u8 | flags u8 | 0 (5) | request u64 | cookie u64 | buffer u64
//!              | key (16) | remote offset u64 | length u64                    (64 bytes)
//! ```
//!
//! With the job's secret ([`Auth::JobSecret`]) both ends prove they hold it, each with its own
//! label over the whole [`transcript`] (the hello as sent, the server's answer and nonce), so a
//! server's proof is never a client's; a hello that names the server's own token as the
//! client's (a connection reflected back to the endpoint that made it) is refused. Then, unless
//! both ends asked for [`Frames::Exposed`], every frame travels sealed ([`super::seal`], keys
//! from the secret and the transcript): its header as one record (64 + 16 bytes), its payload
//! as records of at most [`super::seal::RECORD_MAX`] bytes each. A relay that carried the
//! handshake through can then neither read nor change nor add a byte: the first record that
//! fails to open ends the connection, before anything it says is done.
//!
//! Requests (client → server): WRITE carries `length` bytes for `[remote offset, +length)` of
//! registration `buffer`, READ asks for them. Replies (server → client) echo `request` and
//! `cookie` (the client's offset within its local buffer): ACK for a write, DATA followed by the
//! bytes for a read, ERROR followed by a UTF-8 message of `length` bytes. Unlike PyTorch's
//! prototype, the handshake is answered (a refused flow fails `connect` with a reason instead
//! of a silent close), a refused request fails only itself, and any number of requests may be in
//! flight on a connection.
//!
//! ATOMIC (client → server) is a remote atomic on one aligned word of a registration, the way
//! RDMA and NVSHMEM signal a peer: `status` names the operation ([`Atomic`]), `cookie` carries the
//! operand and `length` the word's size. The target performs it with an atomic instruction and
//! wakes whoever sleeps on the word, then answers ACK with status 0, or status 1 ("busy") when a
//! signal-slot put finds the previous signal still unconsumed, so the initiator retries.
//!
//! A WRITE or a store ATOMIC (Set32, Set64) with [`POSTED`] in `flags` is answered only if it
//! is refused: the initiator counted it done once sent (requests on a flow are served in
//! order, so a later one lands after it), and a refusal, which it has nobody left to report
//! to, ends the connection. FENCE (client → server, no payload) is answered with FENCE once
//! everything sent before it on the flow has been served: an initiator fences before it
//! closes, so its posted requests land before the connection ends.

/// The handshake's magic.
pub const MAGIC: [u8; 8] = *b"SYMTCP04";
/// Hello length.
pub const HELLO_LEN: usize = 88;
/// Challenge length.
pub const CHALLENGE_LEN: usize = 72;
/// Proof length.
pub const PROOF_LEN: usize = 32;
/// Header length.
pub const HEADER_LEN: usize = 64;
/// The longest error message a server sends.
pub const MAX_ERROR_LEN: u64 = 4096;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Client → server: bytes to store.
    Write = 1,
    /// Server → client: a write landed.
    Ack = 2,
    /// Client → server: bytes wanted.
    Read = 3,
    /// Server → client: bytes of a read.
    Data = 4,
    /// Server → client: the request was refused; the message follows.
    Error = 5,
    /// Client → server: a remote atomic on one word (see [`Atomic`]); no payload.
    Atomic = 6,
    /// Both ways: asks (client → server) and answers (server → client) that everything sent
    /// before it on the flow has been served.
    Fence = 7,
}

/// `flags` bit: the request is answered only if refused.
pub const POSTED: u8 = 1;

/// The remote atomics, carried in an ATOMIC frame's `status` byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Atomic {
    /// Raise a symmetric-memory signal in a 4-byte slot (the signal-pad protocol's put, once:
    /// busy if the slot still holds an unconsumed signal).
    SlotPut = 1,
    /// Store the operand's low 32 bits.
    Set32 = 2,
    /// Store the 64-bit operand.
    Set64 = 3,
}

impl Atomic {
    /// Parses the status byte of an ATOMIC frame.
    pub fn from_byte(b: u8) -> Option<Atomic> {
        Some(match b {
            1 => Atomic::SlotPut,
            2 => Atomic::Set32,
            3 => Atomic::Set64,
            _ => return None,
        })
    }

    /// The size of the word it acts on.
    pub fn width(self) -> u64 {
        match self {
            Atomic::SlotPut | Atomic::Set32 => 4,
            Atomic::Set64 => 8,
        }
    }
}

/// The ACK status of an ATOMIC slot put that found the slot busy.
pub const ATOMIC_BUSY: u8 = 1;

impl Op {
    fn from_byte(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Write,
            2 => Op::Ack,
            3 => Op::Read,
            4 => Op::Data,
            5 => Op::Error,
            6 => Op::Atomic,
            7 => Op::Fence,
            _ => return None,
        })
    }
}

/// One frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The frame's kind.
    pub op: Op,
    /// An ATOMIC's operation; in replies, their detail (an atomic's busy slot); else 0.
    pub status: u8,
    /// [`POSTED`] or 0.
    pub flags: u8,
    /// The client's request id.
    pub request: u64,
    /// Echoed unchanged: the client's offset in its local buffer.
    pub cookie: u64,
    /// The registration addressed.
    pub buffer: u64,
    /// The registration's access key.
    pub key: [u8; 16],
    /// Byte offset in the registration.
    pub remote_offset: u64,
    /// Payload length (WRITE, DATA, ERROR) or bytes requested (READ).
    pub length: u64,
}

/// Why bytes are not a frame or handshake.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Unknown op byte.
    #[error("unknown tcp transport op {0}")]
    UnknownOp(u8),
    /// Reserved bytes not zero.
    #[error("malformed tcp transport header")]
    Reserved,
    /// Wrong handshake magic.
    #[error("not a symmem tcp transport handshake")]
    BadMagic,
}

impl Header {
    /// The 64 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.op as u8;
        b[1] = self.status;
        b[2] = self.flags;
        b[8..16].copy_from_slice(&self.request.to_le_bytes());
        b[16..24].copy_from_slice(&self.cookie.to_le_bytes());
        b[24..32].copy_from_slice(&self.buffer.to_le_bytes());
        b[32..48].copy_from_slice(&self.key);
        b[48..56].copy_from_slice(&self.remote_offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    /// Parses 64 bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let op = Op::from_byte(b[0]).ok_or(FrameError::UnknownOp(b[0]))?;
        if b[2] & !POSTED != 0 || b[3..8].iter().any(|&x| x != 0) {
            return Err(FrameError::Reserved);
        }
        let u = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let mut key = [0u8; 16];
        key.copy_from_slice(&b[32..48]);
        Ok(Header {
            op,
            status: b[1],
            flags: b[2],
            request: u(8..16),
            cookie: u(16..24),
            buffer: u(24..32),
            key,
            remote_offset: u(48..56),
            length: u(56..64),
        })
    }
}

/// How an endpoint authenticates its peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Auth {
    /// The URL's token alone: whoever holds the URL may connect.
    Token = 0,
    /// The token and a proof of the job's secret, both ways (HMAC-SHA256 over the
    /// handshake's transcript): the URL alone is worthless; frames are then sealed unless both
    /// ends ask for [`Frames::Exposed`].
    JobSecret = 1,
}

/// How an end wants its frames to travel once the handshake proved the job's secret (with
/// [`Auth::Token`] they always travel exposed: there is no key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Frames {
    /// In sealed records: encrypted and authenticated, bound to the connection.
    Sealed = 0,
    /// In the clear and unauthenticated: whoever is on the path can read and change them.
    /// Taken only when both ends ask for it.
    Exposed = 1,
}

impl Frames {
    fn from_byte(b: u8) -> Option<Frames> {
        match b {
            0 => Some(Frames::Sealed),
            1 => Some(Frames::Exposed),
            _ => None,
        }
    }
}

impl Auth {
    fn from_byte(b: u8) -> Option<Auth> {
        match b {
            0 => Some(Auth::Token),
            1 => Some(Auth::JobSecret),
            _ => None,
        }
    }
}

/// The first message on every flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The server endpoint's token, from its URL.
    pub server_token: [u8; 16],
    /// The connecting endpoint's token.
    pub client_token: [u8; 16],
    /// This flow's index.
    pub flow: u32,
    /// How many flows the client opens.
    pub flows: u32,
    /// How the client authenticates.
    pub auth: Auth,
    /// How the client wants its frames to travel.
    pub frames: Frames,
    /// The client's fresh nonce.
    pub nonce: [u8; 32],
}

impl Hello {
    /// The wire bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..24].copy_from_slice(&self.server_token);
        b[24..40].copy_from_slice(&self.client_token);
        b[40..44].copy_from_slice(&self.flow.to_le_bytes());
        b[44..48].copy_from_slice(&self.flows.to_le_bytes());
        b[48] = self.auth as u8;
        b[49] = self.frames as u8;
        b[56..88].copy_from_slice(&self.nonce);
        b
    }

    /// Parses the wire bytes.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, FrameError> {
        if b[..8] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        if b[50..56].iter().any(|&x| x != 0) {
            return Err(FrameError::Reserved);
        }
        let auth = Auth::from_byte(b[48]).ok_or(FrameError::Reserved)?;
        let frames = Frames::from_byte(b[49]).ok_or(FrameError::Reserved)?;
        let u = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[r]);
            u32::from_le_bytes(a)
        };
        Ok(Hello {
            server_token: array(&b[8..24]),
            client_token: array(&b[24..40]),
            flow: u(40..44),
            flows: u(44..48),
            auth,
            frames,
            nonce: array(&b[56..88]),
        })
    }
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

/// Why a server refuses a flow, in its challenge's or verdict's status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Refused {
    /// The token does not name this endpoint, or the flow numbers are wrong: a stale URL.
    Token = 1,
    /// This endpoint requires the job's secret and the client offered none.
    SecretRequired = 2,
    /// The client is a process of another user on this host.
    ForeignUser = 3,
    /// The client's proof of the job's secret is wrong.
    BadProof = 4,
    /// This endpoint serves as many connections as it will.
    Busy = 5,
    /// The hello names this endpoint's own token as the client's: this endpoint's own
    /// connection, reflected back to it.
    Reflected = 6,
}

impl Refused {
    /// The status byte's meaning; `None` for 0 (accepted).
    pub fn from_byte(b: u8) -> Option<Refused> {
        Some(match b {
            1 => Refused::Token,
            2 => Refused::SecretRequired,
            3 => Refused::ForeignUser,
            4 => Refused::BadProof,
            6 => Refused::Reflected,
            _ if b != 0 => Refused::Busy,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refused::Token => "the URL's token does not name it (a stale URL?)",
            Refused::SecretRequired => {
                "it requires the job's secret (SYMMEM_JOB_SECRET or SYMMEM_STORE_SECRET) and this process has none"
            }
            Refused::ForeignUser => "this process belongs to another user on its host",
            Refused::BadProof => "this process's job secret is not its job's",
            Refused::Busy => "it serves as many connections as it will",
            Refused::Reflected => {
                "the connection came back to the endpoint that made it (reflected by whoever gave \
                 this process the URL)"
            }
        })
    }
}

/// The server's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// `None` to go on, or why the flow is refused.
    pub refused: Option<Refused>,
    /// How the server authenticates.
    pub auth: Auth,
    /// How the server wants its frames to travel.
    pub frames: Frames,
    /// The server's fresh nonce.
    pub nonce: [u8; 32],
    /// The server's proof of the job's secret (zeros with [`Auth::Token`]).
    pub proof: [u8; 32],
}

impl Challenge {
    /// The wire bytes.
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[0] = self.refused.map_or(0, |r| r as u8);
        b[1] = self.auth as u8;
        b[2] = self.frames as u8;
        b[8..40].copy_from_slice(&self.nonce);
        b[40..72].copy_from_slice(&self.proof);
        b
    }

    /// Parses the wire bytes.
    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Challenge, FrameError> {
        if b[3..8].iter().any(|&x| x != 0) {
            return Err(FrameError::Reserved);
        }
        Ok(Challenge {
            refused: Refused::from_byte(b[0]),
            auth: Auth::from_byte(b[1]).ok_or(FrameError::Reserved)?,
            frames: Frames::from_byte(b[2]).ok_or(FrameError::Reserved)?,
            nonce: array(&b[8..40]),
            proof: array(&b[40..72]),
        })
    }
}

/// What the proofs and the keys of a flow's handshake cover: the hello as sent (both tokens,
/// the flow, the client's modes and nonce), the server's modes and its nonce. A proof is then
/// good for one flow of one connection to one endpoint only, and a change of any of it by
/// someone between the ends fails both proofs.
pub fn transcript(hello: &Hello, challenge: &Challenge) -> Vec<u8> {
    let mut t = Vec::with_capacity(HELLO_LEN + 2 + 32);
    t.extend_from_slice(&hello.encode());
    t.push(challenge.auth as u8);
    t.push(challenge.frames as u8);
    t.extend_from_slice(&challenge.nonce);
    t
}

/// Whether the frames after this handshake travel sealed: both ends proved the job's secret,
/// and not both asked for [`Frames::Exposed`].
pub fn sealed(hello: &Hello, challenge: &Challenge) -> bool {
    hello.auth == Auth::JobSecret
        && challenge.auth == Auth::JobSecret
        && !(hello.frames == Frames::Exposed && challenge.frames == Frames::Exposed)
}

/// The bytes a frame whose header is `h` carries after it (a WRITE's, DATA's or ERROR's
/// payload; nothing for the others).
pub fn payload_len(h: &Header) -> u64 {
    match h.op {
        Op::Write | Op::Data | Op::Error => h.length,
        Op::Read | Op::Ack | Op::Atomic | Op::Fence => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            op: Op::Write,
            status: 0,
            flags: POSTED,
            request: 7,
            cookie: 1 << 40,
            buffer: u64::MAX,
            key: [9; 16],
            remote_offset: 3,
            length: 1 << 20,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = 9;
        assert_eq!(Header::decode(&bad), Err(FrameError::UnknownOp(9)));
        let mut bad = h.encode();
        bad[2] = 2;
        assert_eq!(Header::decode(&bad), Err(FrameError::Reserved));
        let hello = Hello {
            server_token: [1; 16],
            client_token: [2; 16],
            flow: 3,
            flows: 4,
            auth: Auth::JobSecret,
            frames: Frames::Exposed,
            nonce: [5; 32],
        };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        let c = Challenge {
            refused: Some(Refused::ForeignUser),
            auth: Auth::Token,
            frames: Frames::Sealed,
            nonce: [6; 32],
            proof: [7; 32],
        };
        assert_eq!(Challenge::decode(&c.encode()), Ok(c));
        let ok = Challenge { refused: None, ..c };
        assert_eq!(Challenge::decode(&ok.encode()), Ok(ok));
        let r = Challenge { refused: Some(Refused::Reflected), ..c };
        assert_eq!(Challenge::decode(&r.encode()), Ok(r));
        // Every part of the handshake is in the transcript.
        let t = transcript(&hello, &ok);
        assert_ne!(t, transcript(&Hello { flow: 2, ..hello }, &ok));
        assert_ne!(t, transcript(&Hello { client_token: [9; 16], ..hello }, &ok));
        assert_ne!(t, transcript(&Hello { frames: Frames::Sealed, ..hello }, &ok));
        assert_ne!(t, transcript(&hello, &Challenge { nonce: [1; 32], ..ok }));
        assert_ne!(t, transcript(&hello, &Challenge { frames: Frames::Exposed, ..ok }));
        // Sealed unless both ends ask otherwise, and only with the secret.
        let secret = Challenge { auth: Auth::JobSecret, ..ok };
        assert!(!sealed(&hello, &Challenge { frames: Frames::Exposed, ..secret }));
        assert!(sealed(&hello, &secret));
        assert!(sealed(&Hello { frames: Frames::Sealed, ..hello }, &Challenge { frames: Frames::Exposed, ..secret }));
        assert!(!sealed(&Hello { auth: Auth::Token, frames: Frames::Sealed, ..hello }, &secret));
    }

    proptest! {
        #[test]
        fn decoding_never_panics(b in proptest::array::uniform32(any::<u8>()), c in proptest::array::uniform32(any::<u8>())) {
            let mut h = [0u8; HEADER_LEN];
            h[..32].copy_from_slice(&b);
            h[32..].copy_from_slice(&c);
            let _ = Header::decode(&h);
            let mut s = [0u8; HELLO_LEN];
            s[..64].copy_from_slice(&h);
            s[64..].copy_from_slice(&h[..24]);
            let _ = Hello::decode(&s);
            let mut c = [0u8; CHALLENGE_LEN];
            c[..64].copy_from_slice(&h);
            let _ = Challenge::decode(&c);
        }
    }
}
