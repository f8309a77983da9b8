//! The `tcp` transport's wire format: a handshake per flow, then fixed 64-byte frame headers,
//! little-endian, followed by the payload the header announces.
//!
//! ```text
//!   handshake  client → server   magic "SYMTCP01" | server token (16) | client token (16)
//!                                | flow index u32 | flow count u32            (48 bytes)
//!              server → client   status u8: 0 accepted, else refused         (1 byte)
//!
//!   header     op u8 | status u8 | 0 (6) | request u64 | cookie u64 | buffer u64
//!              | key (16) | remote offset u64 | length u64                    (64 bytes)
//! ```
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

/// The handshake's magic.
pub const MAGIC: [u8; 8] = *b"SYMTCP01";
/// Handshake length.
pub const HANDSHAKE_LEN: usize = 48;
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
}

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
            _ => return None,
        })
    }
}

/// One frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The frame's kind.
    pub op: Op,
    /// Reserved for replies' detail; 0.
    pub status: u8,
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
        if b[2..8].iter().any(|&x| x != 0) {
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
            request: u(8..16),
            cookie: u(16..24),
            buffer: u(24..32),
            key,
            remote_offset: u(48..56),
            length: u(56..64),
        })
    }
}

/// The first message on every flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// The server endpoint's token, from its URL.
    pub server_token: [u8; 16],
    /// The connecting endpoint's token.
    pub client_token: [u8; 16],
    /// This flow's index.
    pub flow: u32,
    /// How many flows the client opens.
    pub flows: u32,
}

impl Handshake {
    /// The 48 wire bytes.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut b = [0u8; HANDSHAKE_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..24].copy_from_slice(&self.server_token);
        b[24..40].copy_from_slice(&self.client_token);
        b[40..44].copy_from_slice(&self.flow.to_le_bytes());
        b[44..48].copy_from_slice(&self.flows.to_le_bytes());
        b
    }

    /// Parses 48 bytes.
    pub fn decode(b: &[u8; HANDSHAKE_LEN]) -> Result<Handshake, FrameError> {
        if b[..8] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        let mut server_token = [0u8; 16];
        server_token.copy_from_slice(&b[8..24]);
        let mut client_token = [0u8; 16];
        client_token.copy_from_slice(&b[24..40]);
        let u = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[r]);
            u32::from_le_bytes(a)
        };
        Ok(Handshake { server_token, client_token, flow: u(40..44), flows: u(44..48) })
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
        let hs = Handshake { server_token: [1; 16], client_token: [2; 16], flow: 3, flows: 4 };
        assert_eq!(Handshake::decode(&hs.encode()), Ok(hs));
    }

    proptest! {
        #[test]
        fn decoding_never_panics(b in proptest::array::uniform32(any::<u8>()), c in proptest::array::uniform32(any::<u8>())) {
            let mut h = [0u8; HEADER_LEN];
            h[..32].copy_from_slice(&b);
            h[32..].copy_from_slice(&c);
            let _ = Header::decode(&h);
            let mut s = [0u8; HANDSHAKE_LEN];
            s.copy_from_slice(&h[..48]);
            let _ = Handshake::decode(&s);
        }
    }
}
