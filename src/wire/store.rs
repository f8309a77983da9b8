//! PyTorch's TCPStore wire protocol (torch 2.15), plus symmem's authentication extension.
//!
//! Every message is one query-type byte followed by fields; there is no length header, so a
//! message's length comes only from its fields (`docs/tcpstore-protocol.md` §1–§2).
//! Integers are little-endian; `str` and `bytes` are a `u64` length followed by raw bytes.
//!
//! This module is pure: it turns bytes into [`Request`]s and [`Reply`]s and back, and never does
//! I/O. Decoding takes a buffer that may hold a partial message, several messages, or garbage:
//! it returns `Ok(None)` when more bytes are needed, `Ok(Some((message, consumed)))` for one
//! whole message, or a [`DecodeError`] naming what was wrong. It never panics, on any input
//! (a property test and a fuzz target check this).
//!
//! The authentication extension uses query types `0xA0`/`0xA1`, which PyTorch never sends.

use std::fmt;

/// The magic number of the VALIDATE handshake (`validationMagicNumber` in torch).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The length of the nonces exchanged by the authentication extension.
pub const NONCE_LEN: usize = 32;

/// The length of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;

/// Bounds on what one message may carry; larger fields are rejected as soon as their length
/// header arrives, before any of their bytes are buffered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The longest key, in bytes (torch's libuv server: 8192).
    pub max_key_len: u64,
    /// The longest value, in bytes (torch's libuv server: 8 MiB, inclusive). A server also
    /// holds APPEND's result to it.
    pub max_value_len: u64,
    /// The most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET (torch's libuv server: 131072).
    pub max_keys: u64,
    /// The longest whole message, in bytes: a MULTI_SET of many large values is refused as
    /// soon as its headers add up past this (torch sets no such bound).
    pub max_message: u64,
    /// The longest reply a server sends to one request (MULTI_GET, LIST_KEYS); a request whose
    /// reply would be longer is refused, not built (torch sets no such bound).
    pub max_reply: u64,
}

impl Limits {
    /// The limits symmem's server enforces: torch's libuv server's, plus the message and reply
    /// bounds.
    pub const SERVER: Limits = Limits {
        max_key_len: 8192,
        max_value_len: 8 * 1024 * 1024,
        max_keys: 131_072,
        max_message: 64 << 20,
        max_reply: 64 << 20,
    };

    /// What a client accepts in replies: generous, since legacy torch servers do not bound
    /// values, but bounded so that a lying server cannot make a client allocate without limit.
    pub const CLIENT: Limits = Limits {
        max_key_len: 1 << 20,
        max_value_len: 1 << 30,
        max_keys: 1 << 24,
        max_message: 1 << 32,
        max_reply: 1 << 32,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::SERVER
    }
}

/// Query types (`enum class QueryType : uint8_t` in torch), and symmem's extensions.
#[allow(missing_docs)] // the names are the protocol's; the table in the module docs describes them
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    Validate = 0x00,
    Set = 0x01,
    CompareSet = 0x02,
    Get = 0x03,
    Add = 0x04,
    Check = 0x05,
    Wait = 0x06,
    GetNumKeys = 0x07,
    DeleteKey = 0x08,
    Append = 0x09,
    MultiGet = 0x0A,
    MultiSet = 0x0B,
    CancelWait = 0x0C,
    Ping = 0x0D,
    QueuePush = 0x0E,
    QueuePop = 0x0F,
    QueueLen = 0x10,
    ListKeys = 0x11,
    Barrier = 0x12,
    /// symmem extension: `bytes client_nonce`; the reply is `bytes server_nonce, bytes proof`.
    AuthBegin = 0xA0,
    /// symmem extension: `bytes proof`; the reply is `u8 0` on success, a close otherwise.
    AuthProof = 0xA1,
}

impl QueryType {
    /// The query type of a wire byte, if it is one.
    pub fn from_byte(b: u8) -> Option<QueryType> {
        use QueryType::*;
        Some(match b {
            0x00 => Validate,
            0x01 => Set,
            0x02 => CompareSet,
            0x03 => Get,
            0x04 => Add,
            0x05 => Check,
            0x06 => Wait,
            0x07 => GetNumKeys,
            0x08 => DeleteKey,
            0x09 => Append,
            0x0A => MultiGet,
            0x0B => MultiSet,
            0x0C => CancelWait,
            0x0D => Ping,
            0x0E => QueuePush,
            0x0F => QueuePop,
            0x10 => QueueLen,
            0x11 => ListKeys,
            0x12 => Barrier,
            0xA0 => AuthBegin,
            0xA1 => AuthProof,
            _ => return None,
        })
    }
}

/// The byte a WAIT or BARRIER gets when every key exists (`WaitResponseType::STOP_WAITING`).
pub const STOP_WAITING: u8 = 0;
/// The byte CANCEL_WAIT gets (`WaitResponseType::WAIT_CANCELED`).
pub const WAIT_CANCELED: u8 = 1;
/// CHECK's reply when every key exists (`CheckResponseType::READY`).
pub const READY: u8 = 0;
/// CHECK's reply when some key is missing (`CheckResponseType::NOT_READY`).
pub const NOT_READY: u8 = 1;

/// One request, client to server. Keys and values are arbitrary bytes.
#[allow(missing_docs)] // fields are named after the protocol's; see the module table
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Validate { magic: u32 },
    Set { key: Vec<u8>, value: Vec<u8> },
    CompareSet { key: Vec<u8>, expected: Vec<u8>, desired: Vec<u8> },
    Get { key: Vec<u8> },
    Add { key: Vec<u8>, delta: i64 },
    Check { keys: Vec<Vec<u8>> },
    Wait { keys: Vec<Vec<u8>> },
    GetNumKeys,
    DeleteKey { key: Vec<u8> },
    Append { key: Vec<u8>, value: Vec<u8> },
    MultiGet { keys: Vec<Vec<u8>> },
    MultiSet { pairs: Vec<(Vec<u8>, Vec<u8>)> },
    CancelWait,
    Ping { nonce: u32 },
    QueuePush { key: Vec<u8>, value: Vec<u8> },
    QueuePop { key: Vec<u8> },
    QueueLen { key: Vec<u8> },
    ListKeys,
    Barrier { key: Vec<u8>, world_size: i64 },
    AuthBegin { client_nonce: Vec<u8> },
    AuthProof { proof: Vec<u8> },
}

/// Why bytes could not be decoded. Each names what was wrong; the connection that sent them is
/// closed, and nothing else is affected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The first byte of a message is not a known query type.
    #[error("unknown query type 0x{0:02x}")]
    UnknownQuery(u8),
    /// A key's length header exceeds [`Limits::max_key_len`].
    #[error("key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLong {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A value's length header exceeds [`Limits::max_value_len`].
    #[error("value of {len} bytes exceeds the limit of {max} bytes")]
    ValueTooLong {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A key count exceeds [`Limits::max_keys`].
    #[error("{count} keys in one message exceed the limit of {max}")]
    TooManyKeys {
        /// The announced count.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A nonce or proof has the wrong length.
    #[error("{what} of {len} bytes, expected {expected}")]
    BadLength {
        /// Which field.
        what: &'static str,
        /// The announced length.
        len: u64,
        /// The required length.
        expected: u64,
    },
    /// A count or length that is negative where only non-negative values make sense.
    #[error("negative {what}: {value}")]
    Negative {
        /// Which field.
        what: &'static str,
        /// The value received.
        value: i64,
    },
    /// The fields announced so far add up past [`Limits::max_message`].
    #[error("message of at least {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLong {
        /// The length announced so far.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Decoding stops either for lack of bytes or because the bytes are wrong.
enum Stop {
    Incomplete,
    Invalid(DecodeError),
}

impl From<DecodeError> for Stop {
    fn from(e: DecodeError) -> Self {
        Stop::Invalid(e)
    }
}

type Step<T> = Result<T, Stop>;

/// A cursor over a possibly partial message.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Step<&'a [u8]> {
        let end = self.pos.saturating_add(n);
        if end as u64 > self.limits.max_message {
            return Err(DecodeError::MessageTooLong { len: end as u64, max: self.limits.max_message }.into());
        }
        let s = self.buf.get(self.pos..end).ok_or(Stop::Incomplete)?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Step<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Step<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Step<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Step<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Step<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed field, refused as soon as its header shows it is longer than `max`.
    fn sized(&mut self, max: u64, too_long: fn(u64, u64) -> DecodeError) -> Step<Vec<u8>> {
        let len = self.u64()?;
        if len > max {
            return Err(too_long(len, max).into());
        }
        // `len <= max`, and every max fits in usize on the 64-bit targets symmem supports.
        let n = usize::try_from(len).map_err(|_| too_long(len, max))?;
        Ok(self.take(n)?.to_vec())
    }

    fn key(&mut self) -> Step<Vec<u8>> {
        self.sized(self.limits.max_key_len, |len, max| DecodeError::KeyTooLong { len, max })
    }

    fn value(&mut self) -> Step<Vec<u8>> {
        self.sized(self.limits.max_value_len, |len, max| DecodeError::ValueTooLong { len, max })
    }

    fn exact(&mut self, what: &'static str, expected: usize) -> Step<Vec<u8>> {
        let len = self.u64()?;
        if len != expected as u64 {
            return Err(DecodeError::BadLength { what, len, expected: expected as u64 }.into());
        }
        Ok(self.take(expected)?.to_vec())
    }

    fn count(&mut self) -> Step<usize> {
        let count = self.u64()?;
        if count > self.limits.max_keys {
            return Err(DecodeError::TooManyKeys { count, max: self.limits.max_keys }.into());
        }
        Ok(count as usize)
    }

    fn keys(&mut self) -> Step<Vec<Vec<u8>>> {
        let n = self.count()?;
        // Do not trust `n` for the allocation: grow as keys actually arrive.
        let mut keys = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

fn finish<T>(step: Step<T>, reader: &Reader<'_>) -> Result<Option<(T, usize)>, DecodeError> {
    match step {
        Ok(v) => Ok(Some((v, reader.pos))),
        Err(Stop::Incomplete) => Ok(None),
        Err(Stop::Invalid(e)) => Err(e),
    }
}

impl Request {
    /// Decodes one request from the front of `buf`.
    ///
    /// Returns `Ok(None)` if `buf` holds only part of a request, `Ok(Some((request, n)))` when
    /// the first `n` bytes are one request, and an error for bytes that can never become one.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Request, usize)>, DecodeError> {
        let mut r = Reader { buf, pos: 0, limits };
        let step = Self::decode_fields(&mut r);
        finish(step, &r)
    }

    fn decode_fields(r: &mut Reader<'_>) -> Step<Request> {
        let byte = r.u8()?;
        let query = QueryType::from_byte(byte).ok_or(DecodeError::UnknownQuery(byte))?;
        Ok(match query {
            QueryType::Validate => Request::Validate { magic: r.u32()? },
            QueryType::Set => Request::Set { key: r.key()?, value: r.value()? },
            QueryType::CompareSet => Request::CompareSet { key: r.key()?, expected: r.value()?, desired: r.value()? },
            QueryType::Get => Request::Get { key: r.key()? },
            QueryType::Add => Request::Add { key: r.key()?, delta: r.i64()? },
            QueryType::Check => Request::Check { keys: r.keys()? },
            QueryType::Wait => Request::Wait { keys: r.keys()? },
            QueryType::GetNumKeys => Request::GetNumKeys,
            QueryType::DeleteKey => Request::DeleteKey { key: r.key()? },
            QueryType::Append => Request::Append { key: r.key()?, value: r.value()? },
            QueryType::MultiGet => Request::MultiGet { keys: r.keys()? },
            QueryType::MultiSet => {
                let n = r.count()?;
                let mut pairs = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    pairs.push((r.key()?, r.value()?));
                }
                Request::MultiSet { pairs }
            }
            QueryType::CancelWait => Request::CancelWait,
            QueryType::Ping => Request::Ping { nonce: r.u32()? },
            QueryType::QueuePush => Request::QueuePush { key: r.key()?, value: r.value()? },
            QueryType::QueuePop => Request::QueuePop { key: r.key()? },
            QueryType::QueueLen => Request::QueueLen { key: r.key()? },
            QueryType::ListKeys => Request::ListKeys,
            QueryType::Barrier => Request::Barrier { key: r.key()?, world_size: r.i64()? },
            QueryType::AuthBegin => Request::AuthBegin { client_nonce: r.exact("client nonce", NONCE_LEN)? },
            QueryType::AuthProof => Request::AuthProof { proof: r.exact("proof", PROOF_LEN)? },
        })
    }

    /// The query type of this request.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
            Request::Barrier { .. } => QueryType::Barrier,
            Request::AuthBegin { .. } => QueryType::AuthBegin,
            Request::AuthProof { .. } => QueryType::AuthProof,
        }
    }

    /// Appends the wire bytes of this request to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.query_type() as u8);
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_le_bytes()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                put_u64(out, keys.len() as u64);
                for k in keys {
                    put_bytes(out, k);
                }
            }
            Request::MultiSet { pairs } => {
                put_u64(out, pairs.len() as u64);
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Request::AuthBegin { client_nonce: b } | Request::AuthProof { proof: b } => put_bytes(out, b),
        }
    }

    /// The shape of the reply this request gets, or `None` for requests that get no reply.
    pub fn reply_shape(&self) -> Option<ReplyShape> {
        Some(match self {
            Request::Validate { .. }
            | Request::Set { .. }
            | Request::Append { .. }
            | Request::MultiSet { .. }
            | Request::QueuePush { .. } => return None,
            Request::CompareSet { .. } | Request::Get { .. } => ReplyShape::Bytes,
            Request::Add { .. } | Request::GetNumKeys | Request::DeleteKey { .. } | Request::QueueLen { .. } => {
                ReplyShape::I64
            }
            Request::Check { .. }
            | Request::Wait { .. }
            | Request::CancelWait
            | Request::Barrier { .. }
            | Request::AuthProof { .. } => ReplyShape::U8,
            Request::MultiGet { keys } => ReplyShape::Values(keys.len()),
            Request::Ping { .. } => ReplyShape::U32,
            Request::QueuePop { .. } => ReplyShape::QueuePop,
            Request::ListKeys => ReplyShape::Keys,
            Request::AuthBegin { .. } => ReplyShape::AuthChallenge,
        })
    }
}

/// One field of a request, as [`Framer`] walks it.
#[derive(Clone, Copy, Debug)]
enum Field {
    U32,
    I64,
    Key,
    Value,
    /// A count, then that many keys.
    Keys,
    /// A count, then that many key-value pairs.
    Pairs,
    /// A `bytes` of exactly this length (nonces, proofs).
    Exact(u64),
}

impl QueryType {
    /// The fields that follow this query type's byte in a request.
    fn fields(self) -> &'static [Field] {
        use Field::*;
        use QueryType as Q;
        match self {
            Q::Validate | Q::Ping => &[U32],
            Q::Set | Q::Append | Q::QueuePush => &[Key, Value],
            Q::CompareSet => &[Key, Value, Value],
            Q::Get | Q::DeleteKey | Q::QueuePop | Q::QueueLen => &[Key],
            Q::Add | Q::Barrier => &[Key, I64],
            Q::Check | Q::Wait | Q::MultiGet => &[Keys],
            Q::MultiSet => &[Pairs],
            Q::GetNumKeys | Q::CancelWait | Q::ListKeys => &[],
            Q::AuthBegin => &[Exact(NONCE_LEN as u64)],
            Q::AuthProof => &[Exact(PROOF_LEN as u64)],
        }
    }
}

/// Finds where the request at the front of a growing buffer ends, without decoding or copying
/// it, and resumes where it stopped when more bytes arrive: each length header is read once,
/// so a message that trickles in costs time linear in its size (re-decoding it from the start
/// at every read was quadratic). Limits are enforced as each header arrives, so a server
/// buffers no more than [`Limits::max_message`] of any request. Once it reports a length, the
/// message decodes with [`Request::decode`] (which checks the same limits).
#[derive(Clone, Debug, Default)]
pub struct Framer {
    /// Where the next unread header starts, from the message's first byte.
    pos: u64,
    /// The message's query type, once its first byte was read.
    query: Option<QueryType>,
    /// The index of the next field in `query.fields()`.
    field: usize,
    /// For `Keys` and `Pairs`: the items (keys, or key then value) still to walk.
    items: Option<u64>,
}

impl Framer {
    /// A framer at the start of a message.
    pub fn new() -> Framer {
        Framer::default()
    }

    /// The query type of the message being framed, once its first byte has arrived.
    pub fn query(&self) -> Option<QueryType> {
        self.query
    }

    /// Walks `buf` (the message's bytes so far, from its first) as far as it goes. Returns the
    /// message's length once it is whole, `Ok(None)` while bytes are missing (call again with
    /// more), or why the bytes can never be a request. After `Some`, [`Framer::new`] a new one
    /// for the next message.
    pub fn advance(&mut self, buf: &[u8], limits: &Limits) -> Result<Option<usize>, DecodeError> {
        let have = buf.len() as u64;
        let query = match self.query {
            Some(q) => q,
            None => {
                let Some(&b) = buf.first() else { return Ok(None) };
                let q = QueryType::from_byte(b).ok_or(DecodeError::UnknownQuery(b))?;
                self.query = Some(q);
                self.pos = 1;
                q
            }
        };
        let fields = query.fields();
        loop {
            if let Some(left) = self.items {
                if left == 0 {
                    self.items = None;
                    self.field += 1;
                    continue;
                }
                let kind = match fields[self.field] {
                    Field::Pairs if left % 2 == 1 => Field::Value,
                    _ => Field::Key,
                };
                let Some(len) = self.length(buf)? else { return Ok(None) };
                self.check_len(query, kind, len, limits)?;
                self.skip(len.saturating_add(8), limits)?;
                self.items = Some(left - 1);
                continue;
            }
            let Some(&f) = fields.get(self.field) else {
                // Every field walked: the message is whole if its last bytes are here.
                return Ok((self.pos <= have).then_some(self.pos as usize));
            };
            if self.pos > have {
                return Ok(None);
            }
            match f {
                Field::U32 => self.skip(4, limits)?,
                Field::I64 => self.skip(8, limits)?,
                Field::Key | Field::Value | Field::Exact(_) => {
                    let Some(len) = self.length(buf)? else { return Ok(None) };
                    self.check_len(query, f, len, limits)?;
                    self.skip(len.saturating_add(8), limits)?;
                }
                Field::Keys | Field::Pairs => {
                    let Some(count) = self.length(buf)? else { return Ok(None) };
                    if count > limits.max_keys {
                        return Err(DecodeError::TooManyKeys { count, max: limits.max_keys });
                    }
                    self.skip(8, limits)?;
                    // `count <= max_keys`, far below 2^62.
                    self.items = Some(if matches!(f, Field::Pairs) { 2 * count } else { count });
                    continue;
                }
            }
            self.field += 1;
        }
    }

    /// The `u64` at `pos`, if it has arrived.
    fn length(&self, buf: &[u8]) -> Result<Option<u64>, DecodeError> {
        // `pos <= max_message`, which fits in usize on the 64-bit targets symmem supports.
        let Ok(at) = usize::try_from(self.pos) else { return Ok(None) };
        Ok(buf.get(at..at.saturating_add(8)).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes))
    }

    fn check_len(&self, query: QueryType, f: Field, len: u64, limits: &Limits) -> Result<(), DecodeError> {
        match f {
            Field::Key if len > limits.max_key_len => Err(DecodeError::KeyTooLong { len, max: limits.max_key_len }),
            Field::Value if len > limits.max_value_len => {
                Err(DecodeError::ValueTooLong { len, max: limits.max_value_len })
            }
            Field::Exact(n) if len != n => {
                let what = if query == QueryType::AuthProof { "proof" } else { "client nonce" };
                Err(DecodeError::BadLength { what, len, expected: n })
            }
            _ => Ok(()),
        }
    }

    /// Moves past `n` bytes (which need not have arrived), within the message bound.
    fn skip(&mut self, n: u64, limits: &Limits) -> Result<(), DecodeError> {
        let end = self.pos.saturating_add(n);
        if end > limits.max_message {
            return Err(DecodeError::MessageTooLong { len: end, max: limits.max_message });
        }
        self.pos = end;
        Ok(())
    }
}

/// Appends a `u64` length and the bytes: the encoding of `str` and `bytes`.
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// Appends a little-endian `u64`.
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// What a client expects back for a request; replies carry no type tag of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyShape {
    /// One byte (CHECK, WAIT, CANCEL_WAIT, BARRIER, AUTH_PROOF).
    U8,
    /// One `i64` (ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN).
    I64,
    /// One `u32` (PING).
    U32,
    /// One `bytes` (GET, COMPARE_SET).
    Bytes,
    /// `n` `bytes` with no count prefix (MULTI_GET).
    Values(usize),
    /// `i64 n` then `n` keys (LIST_KEYS).
    Keys,
    /// `i64 len_before_pop`, then a `bytes` value if it was positive (QUEUE_POP).
    QueuePop,
    /// `bytes server_nonce, bytes proof` (AUTH_BEGIN).
    AuthChallenge,
}

/// One reply, server to client.
#[allow(missing_docs)] // each variant is the decoded form of the [`ReplyShape`] of the same name
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    U8(u8),
    I64(i64),
    U32(u32),
    Bytes(Vec<u8>),
    Values(Vec<Vec<u8>>),
    Keys(Vec<Vec<u8>>),
    QueuePop(Option<Vec<u8>>),
    AuthChallenge { server_nonce: Vec<u8>, proof: Vec<u8> },
}

impl Reply {
    /// Decodes one reply of the given shape from the front of `buf`; `Ok(None)` means more
    /// bytes are needed.
    pub fn decode(shape: ReplyShape, buf: &[u8], limits: &Limits) -> Result<Option<(Reply, usize)>, DecodeError> {
        let mut r = Reader { buf, pos: 0, limits };
        let step = Self::decode_fields(shape, &mut r);
        finish(step, &r)
    }

    fn decode_fields(shape: ReplyShape, r: &mut Reader<'_>) -> Step<Reply> {
        Ok(match shape {
            ReplyShape::U8 => Reply::U8(r.u8()?),
            ReplyShape::I64 => Reply::I64(r.i64()?),
            ReplyShape::U32 => Reply::U32(r.u32()?),
            ReplyShape::Bytes => Reply::Bytes(r.value()?),
            ReplyShape::Values(n) => {
                let mut values = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    values.push(r.value()?);
                }
                Reply::Values(values)
            }
            ReplyShape::Keys => {
                let n = r.i64()?;
                if n < 0 {
                    return Err(DecodeError::Negative { what: "key count", value: n }.into());
                }
                let n = n as u64;
                if n > r.limits.max_keys {
                    return Err(DecodeError::TooManyKeys { count: n, max: r.limits.max_keys }.into());
                }
                let mut keys = Vec::with_capacity((n as usize).min(1024));
                for _ in 0..n {
                    keys.push(r.key()?);
                }
                Reply::Keys(keys)
            }
            ReplyShape::QueuePop => {
                let len = r.i64()?;
                if len < 0 {
                    return Err(DecodeError::Negative { what: "queue length", value: len }.into());
                }
                Reply::QueuePop(if len > 0 { Some(r.value()?) } else { None })
            }
            ReplyShape::AuthChallenge => Reply::AuthChallenge {
                server_nonce: r.exact("server nonce", NONCE_LEN)?,
                proof: r.exact("proof", PROOF_LEN)?,
            },
        })
    }
}

/// Server-side reply encoders: each returns the wire bytes of one reply.
pub mod reply {
    use super::put_bytes;

    /// One `bytes`.
    pub fn bytes(b: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + b.len());
        put_bytes(&mut out, b);
        out
    }

    /// A single byte (CHECK, WAIT, CANCEL_WAIT, BARRIER, AUTH_PROOF).
    pub fn u8(b: u8) -> Vec<u8> {
        vec![b]
    }

    /// An `i64`.
    pub fn i64(v: i64) -> Vec<u8> {
        v.to_le_bytes().to_vec()
    }

    /// A `u32` (PING).
    pub fn u32(v: u32) -> Vec<u8> {
        v.to_le_bytes().to_vec()
    }
}

impl fmt::Display for QueryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn encoded(r: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        r.encode(&mut out);
        out
    }

    /// The byte captures of `docs/tcpstore-protocol.md` §3, from a torch client.
    #[test]
    fn matches_torch_captures() {
        let cases = [
            ("00 cef7853c", Request::Validate { magic: VALIDATION_MAGIC }),
            ("0d 021f0000", Request::Ping { nonce: 0x1f02 }),
            (
                "01 0300000000000000 2f6b31 0200000000000000 7631",
                Request::Set { key: b"/k1".to_vec(), value: b"v1".to_vec() },
            ),
            ("04 0400000000000000 2f636e74 0500000000000000", Request::Add { key: b"/cnt".to_vec(), delta: 5 }),
            (
                "05 0200000000000000 0300000000000000 2f6b31 0600000000000000 2f6e6f6b6579",
                Request::Check { keys: vec![b"/k1".to_vec(), b"/nokey".to_vec()] },
            ),
            ("07", Request::GetNumKeys),
            ("0f 0200000000000000 2f71", Request::QueuePop { key: b"/q".to_vec() }),
            ("12 0300000000000000 2f626b 0100000000000000", Request::Barrier { key: b"/bk".to_vec(), world_size: 1 }),
            ("06 0100000000000000 0600000000000000 2f6e65766572", Request::Wait { keys: vec![b"/never".to_vec()] }),
            ("0c", Request::CancelWait),
        ];
        for (bytes, req) in cases {
            let bytes = hex(bytes);
            assert_eq!(encoded(&req), bytes, "encoding {req:?}");
            assert_eq!(Request::decode(&bytes, &Limits::SERVER), Ok(Some((req, bytes.len()))));
        }
    }

    #[test]
    fn decodes_torch_reply_captures() {
        let pop = hex("0100000000000000 0100000000000000 78");
        assert_eq!(
            Reply::decode(ReplyShape::QueuePop, &pop, &Limits::CLIENT),
            Ok(Some((Reply::QueuePop(Some(b"x".to_vec())), pop.len())))
        );
        let keys = hex("0200000000000000 0400000000000000 2f626967 0300000000000000 2f626b");
        assert_eq!(
            Reply::decode(ReplyShape::Keys, &keys, &Limits::CLIENT),
            Ok(Some((Reply::Keys(vec![b"/big".to_vec(), b"/bk".to_vec()]), keys.len())))
        );
        assert_eq!(
            Reply::decode(ReplyShape::QueuePop, &0i64.to_le_bytes(), &Limits::CLIENT),
            Ok(Some((Reply::QueuePop(None), 8)))
        );
    }

    #[test]
    fn partial_input_asks_for_more() {
        let bytes = encoded(&Request::MultiSet {
            pairs: vec![(b"a".to_vec(), b"1".to_vec()), (b"bb".to_vec(), b"22".to_vec())],
        });
        for cut in 0..bytes.len() {
            assert_eq!(Request::decode(&bytes[..cut], &Limits::SERVER), Ok(None), "cut at {cut}");
        }
        assert!(Request::decode(&bytes, &Limits::SERVER).unwrap().is_some());
    }

    #[test]
    fn a_large_message_is_walked_once_and_bounded() {
        // A MULTI_SET whose headers announce more than max_message is refused from its headers.
        let mut bytes = vec![QueryType::MultiSet as u8];
        put_u64(&mut bytes, 100);
        for _ in 0..8 {
            put_bytes(&mut bytes, b"k");
            put_u64(&mut bytes, 8 << 20);
            bytes.extend(std::iter::repeat_n(0u8, 8 << 20));
        }
        let mut f = Framer::new();
        assert!(matches!(f.advance(&bytes, &Limits::SERVER), Err(DecodeError::MessageTooLong { .. })));
        assert!(matches!(Request::decode(&bytes, &Limits::SERVER), Err(DecodeError::MessageTooLong { .. })));
        // A 1000-pair MULTI_SET arriving a byte at a time: each header read once.
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..1000u32).map(|i| (i.to_le_bytes().to_vec(), vec![7; 100])).collect();
        let msg = encoded(&Request::MultiSet { pairs });
        let mut f = Framer::new();
        for end in 1..msg.len() {
            assert_eq!(f.advance(&msg[..end], &Limits::SERVER), Ok(None));
        }
        assert_eq!(f.advance(&msg, &Limits::SERVER), Ok(Some(msg.len())));
        assert_eq!(f.query(), Some(QueryType::MultiSet));
    }

    #[test]
    fn pipelined_requests_decode_one_at_a_time() {
        let mut bytes = encoded(&Request::Ping { nonce: 1 });
        bytes.extend(encoded(&Request::GetNumKeys));
        let (first, n) = Request::decode(&bytes, &Limits::SERVER).unwrap().unwrap();
        assert_eq!(first, Request::Ping { nonce: 1 });
        assert_eq!(Request::decode(&bytes[n..], &Limits::SERVER), Ok(Some((Request::GetNumKeys, 1))));
    }

    #[test]
    fn oversized_fields_are_refused_from_their_header() {
        // Only the length header of the key has arrived; it is already too long.
        let mut bytes = vec![QueryType::Get as u8];
        put_u64(&mut bytes, 8193);
        assert_eq!(Request::decode(&bytes, &Limits::SERVER), Err(DecodeError::KeyTooLong { len: 8193, max: 8192 }));
        let mut bytes = vec![QueryType::Set as u8];
        put_bytes(&mut bytes, b"k");
        put_u64(&mut bytes, 8 * 1024 * 1024 + 1);
        assert!(matches!(Request::decode(&bytes, &Limits::SERVER), Err(DecodeError::ValueTooLong { .. })));
        // Exactly 8 MiB is accepted (the header alone is incomplete, not an error).
        let mut bytes = vec![QueryType::Set as u8];
        put_bytes(&mut bytes, b"k");
        put_u64(&mut bytes, 8 * 1024 * 1024);
        assert_eq!(Request::decode(&bytes, &Limits::SERVER), Ok(None));
        let mut bytes = vec![QueryType::Wait as u8];
        put_u64(&mut bytes, u64::MAX);
        assert!(matches!(Request::decode(&bytes, &Limits::SERVER), Err(DecodeError::TooManyKeys { .. })));
        assert_eq!(Request::decode(&[0x63], &Limits::SERVER), Err(DecodeError::UnknownQuery(0x63)));
    }

    fn arb_bytes() -> impl Strategy<Value = Vec<u8>> + Clone {
        proptest::collection::vec(any::<u8>(), 0..24)
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        let keys = proptest::collection::vec(arb_bytes(), 0..4);
        prop_oneof![
            any::<u32>().prop_map(|magic| Request::Validate { magic }),
            (arb_bytes(), arb_bytes()).prop_map(|(key, value)| Request::Set { key, value }),
            (arb_bytes(), arb_bytes(), arb_bytes()).prop_map(|(key, expected, desired)| Request::CompareSet {
                key,
                expected,
                desired
            }),
            arb_bytes().prop_map(|key| Request::Get { key }),
            (arb_bytes(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
            keys.clone().prop_map(|keys| Request::Check { keys }),
            keys.clone().prop_map(|keys| Request::Wait { keys }),
            keys.prop_map(|keys| Request::MultiGet { keys }),
            proptest::collection::vec((arb_bytes(), arb_bytes()), 0..4).prop_map(|pairs| Request::MultiSet { pairs }),
            Just(Request::GetNumKeys),
            Just(Request::CancelWait),
            Just(Request::ListKeys),
            any::<u32>().prop_map(|nonce| Request::Ping { nonce }),
            (arb_bytes(), any::<i64>()).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
            proptest::collection::vec(any::<u8>(), NONCE_LEN..=NONCE_LEN)
                .prop_map(|client_nonce| Request::AuthBegin { client_nonce }),
        ]
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Request::decode(&bytes, &Limits::SERVER);
            for shape in [ReplyShape::U8, ReplyShape::I64, ReplyShape::Bytes, ReplyShape::Values(3),
                          ReplyShape::Keys, ReplyShape::QueuePop, ReplyShape::AuthChallenge] {
                let _ = Reply::decode(shape, &bytes, &Limits::CLIENT);
            }
        }

        #[test]
        fn requests_round_trip(req in arb_request(), tail in arb_bytes()) {
            let mut bytes = encoded(&req);
            let n = bytes.len();
            bytes.extend(tail);
            prop_assert_eq!(Request::decode(&bytes, &Limits::SERVER), Ok(Some((req, n))));
        }

        /// The framer agrees with the decoder on every input, fed in any pieces.
        #[test]
        fn framing_agrees_with_decoding(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            pieces in proptest::collection::vec(1usize..64, 0..16),
        ) {
            let tiny = Limits { max_message: 300, max_key_len: 40, max_value_len: 60, max_keys: 5, ..Limits::SERVER };
            let want = Request::decode(&bytes, &tiny).map(|r| r.map(|(_, n)| n));
            let mut framer = Framer::new();
            let mut at = 0;
            let mut got = Ok(None);
            for p in pieces.iter().copied().chain(std::iter::once(bytes.len())) {
                at = (at + p).min(bytes.len());
                got = framer.advance(&bytes[..at], &tiny);
                if !matches!(got, Ok(None)) {
                    break;
                }
            }
            prop_assert_eq!(got, want);
        }

        #[test]
        fn requests_frame_whole_in_any_pieces(req in arb_request(), cut in any::<prop::sample::Index>()) {
            let bytes = encoded(&req);
            let cut = cut.index(bytes.len() + 1);
            let mut framer = Framer::new();
            prop_assert_eq!(framer.advance(&bytes[..cut], &Limits::SERVER), Ok((cut == bytes.len()).then_some(cut)));
            prop_assert_eq!(framer.advance(&bytes, &Limits::SERVER), Ok(Some(bytes.len())));
        }

        #[test]
        fn truncated_requests_ask_for_more(req in arb_request(), cut in any::<prop::sample::Index>()) {
            let bytes = encoded(&req);
            let cut = cut.index(bytes.len());
            prop_assert_eq!(Request::decode(&bytes[..cut], &Limits::SERVER), Ok(None));
        }
    }
}
