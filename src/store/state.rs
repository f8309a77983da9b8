//! The store's protocol core: the key-value state and each connection's session, as plain state
//! machines with no I/O (the quinn-proto split). The TCP server feeds them decoded requests and
//! sends the replies they produce; the in-process store uses the same state directly.
//!
//! Semantics follow torch's libuv server (`docs/tcpstore-protocol.md` §3): GET of a
//! missing key answers an empty value, COMPARE_SET and QUEUE_PUSH wake waiters, ADD stores ASCII
//! decimal. Replies may go to other connections than the one that sent the request: a SET wakes
//! every connection whose WAIT it completes.
//!
//! Bounded: values are shared, never copied into replies (a reply holds the stored bytes by
//! reference count), so pipelined GETs of one large value cost no memory per reply; a request
//! whose reply would exceed [`Limits::max_reply`] is refused before anything is built; APPEND
//! cannot grow a value past [`Limits::max_value_len`]. Deliberate differences from torch, which
//! bounds neither.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use crate::store::auth::{self, Role, Secret};
use crate::wire::seal::{Keys, Side};
use crate::wire::store::{self as wire, Limits, QueryType, Request, reply};

/// Identifies one client connection of a server.
pub(crate) type ConnId = u64;

/// One reply's bytes, in pieces: small headers, and stored values shared rather than copied.
pub(crate) type Chunks = Vec<Bytes>;

/// Replies produced by one request: `(connection, bytes)` in the order they must be sent.
pub(crate) type Outbox = Vec<(ConnId, Chunks)>;

/// A small reply, in one piece.
fn small(bytes: Vec<u8>) -> Chunks {
    vec![Bytes::from(bytes)]
}

/// A `bytes` reply: its length, then the value itself (shared).
fn value(v: &Bytes) -> Chunks {
    vec![Bytes::copy_from_slice(&(v.len() as u64).to_le_bytes()), v.clone()]
}

/// The logical length of a reply.
pub(crate) fn reply_len(c: &Chunks) -> usize {
    c.iter().map(Bytes::len).sum()
}

/// Why the server closes a connection. The client only sees the close, as torch's servers never
/// send error messages; the server logs this.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("{0}")]
    Decode(#[from] wire::DecodeError),
    #[error("{0} before the VALIDATE handshake")]
    NotValidated(QueryType),
    #[error("VALIDATE with wrong magic 0x{0:08x}")]
    BadMagic(u32),
    #[error("VALIDATE repeated after the handshake")]
    RepeatedValidate,
    #[error("{0} before authenticating (this store requires a shared secret)")]
    Unauthenticated(QueryType),
    #[error("authentication requested but this store has no secret")]
    NoSecret,
    #[error("authentication proof rejected")]
    BadProof,
    #[error("{0} out of order in the authentication handshake")]
    AuthOutOfOrder(QueryType),
    #[error("ADD on key {key:?} whose value is not an integer")]
    NotAnInteger { key: String },
    #[error("ADD on key {key:?} overflows a 64-bit integer")]
    Overflow { key: String },
    #[error("cannot draw a random nonce: {0}")]
    Random(std::io::Error),
    #[error("{what} reply of {len} bytes would exceed the limit of {max} bytes")]
    ReplyTooLong { what: QueryType, len: u64, max: u64 },
    #[error("APPEND to key {key:?} would make a value of {len} bytes, beyond the limit of {max} bytes")]
    AppendTooLong { key: String, len: u64, max: u64 },
}

fn printable(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// One connection's pending WAIT (or parked BARRIER).
struct Pending {
    /// Distinguishes this wait from earlier, cancelled ones of the same connection.
    id: u64,
    /// How many listed keys are still absent (a key listed twice counts twice, as in torch).
    remaining: usize,
    /// The keys it is registered under, to unregister on cancel or disconnect.
    keys: Vec<Vec<u8>>,
}

/// The key-value map, the queues and the waiters of one store.
pub(crate) struct State {
    kv: HashMap<Vec<u8>, Bytes>,
    queues: HashMap<Vec<u8>, VecDeque<Bytes>>,
    /// For each key, the `(connection, wait id)` pairs waiting for it.
    waiting: HashMap<Vec<u8>, Vec<(ConnId, u64)>>,
    waits: HashMap<ConnId, Pending>,
    next_wait: u64,
    limits: Limits,
}

impl Default for State {
    fn default() -> Self {
        State::new(Limits::SERVER)
    }
}

impl State {
    /// An empty store enforcing `limits` on values and replies.
    pub(crate) fn new(limits: Limits) -> State {
        State {
            kv: HashMap::new(),
            queues: HashMap::new(),
            waiting: HashMap::new(),
            waits: HashMap::new(),
            next_wait: 0,
            limits,
        }
    }

    /// Refuses a `what` reply of `len` bytes beyond the reply limit.
    fn bound_reply(&self, what: QueryType, len: u64) -> Result<(), Refusal> {
        if len > self.limits.max_reply {
            return Err(Refusal::ReplyTooLong { what, len, max: self.limits.max_reply });
        }
        Ok(())
    }

    /// Applies one request from `conn` (which has passed the handshake) and queues its replies.
    pub(crate) fn handle(&mut self, conn: ConnId, req: Request, out: &mut Outbox) -> Result<(), Refusal> {
        match req {
            Request::Set { key, value } => self.set(key, value.into(), out),
            Request::CompareSet { key, expected, desired } => {
                let now = self.compare_set(key, &expected, desired.into(), out);
                out.push((conn, value(&now)));
            }
            Request::Get { key } => {
                let v = self.kv.get(&key).cloned().unwrap_or_default();
                out.push((conn, value(&v)));
            }
            Request::Add { key, delta } => {
                let v = self.add(key, delta, out)?;
                out.push((conn, small(reply::i64(v))));
            }
            Request::Check { keys } => {
                let ready = keys.iter().all(|k| self.present(k));
                out.push((conn, small(reply::u8(if ready { wire::READY } else { wire::NOT_READY }))));
            }
            Request::Wait { keys } => self.wait(conn, keys, out),
            Request::GetNumKeys => out.push((conn, small(reply::i64(self.kv.len() as i64)))),
            Request::DeleteKey { key } => {
                let n = i64::from(self.kv.remove(&key).is_some());
                out.push((conn, small(reply::i64(n))));
            }
            Request::Append { key, value } => self.append(key, &value, out)?,
            Request::MultiGet { keys } => {
                let values: Vec<Bytes> = keys.iter().map(|k| self.kv.get(k).cloned().unwrap_or_default()).collect();
                let len = values.iter().map(|v| 8 + v.len() as u64).sum();
                self.bound_reply(QueryType::MultiGet, len)?;
                out.push((conn, values.iter().flat_map(value).collect()));
            }
            Request::MultiSet { pairs } => {
                for (k, v) in pairs {
                    self.set(k, v.into(), out);
                }
            }
            Request::CancelWait => {
                self.cancel(conn);
                out.push((conn, small(reply::u8(wire::WAIT_CANCELED))));
            }
            Request::Ping { nonce } => out.push((conn, small(reply::u32(nonce)))),
            Request::QueuePush { key, value } => {
                self.queues.entry(key.clone()).or_default().push_back(value.into());
                self.wake_one(&key, out);
            }
            Request::QueuePop { key } => {
                let queue = self.queues.get_mut(&key);
                let len = queue.as_ref().map_or(0, |q| q.len());
                let mut chunks = small(reply::i64(len as i64));
                if let Some(front) = queue.and_then(VecDeque::pop_front) {
                    chunks.extend(value(&front));
                }
                out.push((conn, chunks));
            }
            Request::QueueLen { key } => {
                let len = self.queues.get(&key).map_or(0, VecDeque::len);
                out.push((conn, small(reply::i64(len as i64))));
            }
            Request::ListKeys => {
                let len = 8 + self.kv.keys().map(|k| 8 + k.len() as u64).sum::<u64>();
                self.bound_reply(QueryType::ListKeys, len)?;
                let mut bytes = reply::i64(self.kv.len() as i64);
                for k in self.kv.keys() {
                    wire::put_bytes(&mut bytes, k);
                }
                out.push((conn, small(bytes)));
            }
            Request::Barrier { key, world_size } => {
                // The arrival count does not wake anyone; only the last arrival does (torch).
                let count = self.bump(&key, 1)?;
                self.kv.insert(key.clone(), count.to_string().into());
                if count >= world_size {
                    out.push((conn, small(reply::u8(wire::STOP_WAITING))));
                    self.touch(&key, out);
                } else {
                    self.park(conn, vec![key], 1);
                }
            }
            Request::Validate { .. } => return Err(Refusal::RepeatedValidate),
            req @ (Request::AuthBegin { .. } | Request::AuthProof { .. }) => {
                return Err(Refusal::AuthOutOfOrder(req.query_type()));
            }
        }
        Ok(())
    }

    /// Drops a closed connection's wait state.
    pub(crate) fn disconnect(&mut self, conn: ConnId) {
        self.cancel(conn);
    }

    pub(crate) fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    pub(crate) fn value(&self, key: &[u8]) -> Option<&[u8]> {
        self.kv.get(key).map(|v| &v[..])
    }

    pub(crate) fn len(&self) -> usize {
        self.kv.len()
    }

    pub(crate) fn delete(&mut self, key: &[u8]) -> bool {
        self.kv.remove(key).is_some()
    }

    pub(crate) fn set(&mut self, key: Vec<u8>, value: Bytes, out: &mut Outbox) {
        self.touch(&key, out);
        self.kv.insert(key, value);
    }

    /// Appends `value` to the value at `key`; refused if the result would exceed the value
    /// limit (torch lets APPEND grow a value without bound).
    pub(crate) fn append(&mut self, key: Vec<u8>, value: &[u8], out: &mut Outbox) -> Result<(), Refusal> {
        let old = self.kv.get(&key).map_or(&[][..], |v| &v[..]);
        let len = old.len() as u64 + value.len() as u64;
        if len > self.limits.max_value_len {
            return Err(Refusal::AppendTooLong { key: printable(&key), len, max: self.limits.max_value_len });
        }
        let mut new = Vec::with_capacity(len as usize);
        new.extend_from_slice(old);
        new.extend_from_slice(value);
        self.set(key, new.into(), out);
        Ok(())
    }

    /// torch's ADD: absent counts as 0; the value is stored as ASCII decimal.
    pub(crate) fn add(&mut self, key: Vec<u8>, delta: i64, out: &mut Outbox) -> Result<i64, Refusal> {
        let new = self.bump(&key, delta)?;
        self.set(key, new.to_string().into(), out);
        Ok(new)
    }

    /// The value `key` would hold after adding `delta`.
    fn bump(&self, key: &[u8], delta: i64) -> Result<i64, Refusal> {
        let current = match self.kv.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| Refusal::NotAnInteger { key: printable(key) })?,
        };
        current.checked_add(delta).ok_or_else(|| Refusal::Overflow { key: printable(key) })
    }

    /// torch's COMPARE_SET, including its reply of `expected` for an absent key with a non-empty
    /// `expected` (§3: the reply "lies"). Returns the reply value.
    pub(crate) fn compare_set(&mut self, key: Vec<u8>, expected: &[u8], desired: Bytes, out: &mut Outbox) -> Bytes {
        match self.kv.get(&key) {
            None if expected.is_empty() => {
                self.set(key, desired.clone(), out);
                desired
            }
            None => Bytes::copy_from_slice(expected),
            Some(current) if &current[..] == expected => {
                self.set(key, desired.clone(), out);
                desired
            }
            Some(current) => current.clone(),
        }
    }

    fn wait(&mut self, conn: ConnId, keys: Vec<Vec<u8>>, out: &mut Outbox) {
        self.cancel(conn);
        let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.present(k)).collect();
        if missing.is_empty() {
            out.push((conn, small(reply::u8(wire::STOP_WAITING))));
            return;
        }
        let remaining = missing.len();
        self.park(conn, missing, remaining);
    }

    fn park(&mut self, conn: ConnId, keys: Vec<Vec<u8>>, remaining: usize) {
        self.cancel(conn);
        self.next_wait += 1;
        let id = self.next_wait;
        for k in &keys {
            self.waiting.entry(k.clone()).or_default().push((conn, id));
        }
        self.waits.insert(conn, Pending { id, remaining, keys });
    }

    fn cancel(&mut self, conn: ConnId) {
        let Some(pending) = self.waits.remove(&conn) else { return };
        for k in &pending.keys {
            if let Some(list) = self.waiting.get_mut(k) {
                list.retain(|&(c, id)| !(c == conn && id == pending.id));
                if list.is_empty() {
                    self.waiting.remove(k);
                }
            }
        }
    }

    /// Counts `key` as arrived for every connection waiting on it.
    fn touch(&mut self, key: &[u8], out: &mut Outbox) {
        let Some(list) = self.waiting.remove(key) else { return };
        for (conn, id) in list {
            self.arrived(conn, id, out);
        }
    }

    /// Counts `key` as arrived for the first connection waiting on it (a queue push).
    fn wake_one(&mut self, key: &[u8], out: &mut Outbox) {
        let Some(list) = self.waiting.get_mut(key) else { return };
        let first = list.remove(0);
        if list.is_empty() {
            self.waiting.remove(key);
        }
        self.arrived(first.0, first.1, out);
    }

    fn arrived(&mut self, conn: ConnId, id: u64, out: &mut Outbox) {
        let Some(p) = self.waits.get_mut(&conn) else { return };
        if p.id != id {
            return;
        }
        p.remaining -= 1;
        if p.remaining == 0 {
            self.cancel(conn);
            out.push((conn, small(reply::u8(wire::STOP_WAITING))));
        }
    }
}

/// Where one connection is in the handshake.
enum Phase {
    /// Nothing received yet: the first message must be VALIDATE.
    New,
    /// Validated; this store needs AUTH_BEGIN next.
    NeedAuth,
    /// Challenge sent; waiting for the client's proof.
    Challenged { client_nonce: Vec<u8>, server_nonce: [u8; wire::NONCE_LEN] },
    /// Serving requests.
    Ready,
}

/// One connection's handshake and authentication state.
pub(crate) struct Session {
    conn: ConnId,
    phase: Phase,
    /// The peer is a process of this store's user on this host (its peer credentials say so):
    /// it could read the secret from the ranks' memory anyway, so it need not prove it.
    trusted: bool,
    /// The keys of the connection's sealed stream, from the moment the client's proof was
    /// accepted until the driver takes them: everything after the proof's answer is sealed.
    keys: Option<Box<Keys>>,
}

/// Labels the keys of a store connection's sealed stream.
pub(crate) const STREAM_KEYS: &[u8] = b"symmem-store-v2 stream keys";

/// What the keys of a store connection's sealed stream cover: both nonces of its handshake.
pub(crate) fn stream_transcript(client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(16 + client_nonce.len() + server_nonce.len());
    t.extend_from_slice(&(client_nonce.len() as u64).to_le_bytes());
    t.extend_from_slice(client_nonce);
    t.extend_from_slice(&(server_nonce.len() as u64).to_le_bytes());
    t.extend_from_slice(server_nonce);
    t
}

impl Session {
    pub(crate) fn new(conn: ConnId, trusted: bool) -> Session {
        Session { conn, phase: Phase::New, trusted, keys: None }
    }

    /// The keys of the sealed stream that begins after the answer to the client's proof
    /// (once: the driver seals from then on).
    pub(crate) fn take_keys(&mut self) -> Option<Box<Keys>> {
        self.keys.take()
    }

    /// Whether the client's proof was just accepted: the stream is to be sealed from here.
    pub(crate) fn sealing(&self) -> bool {
        self.keys.is_some()
    }

    /// The only request this connection may send next while it is in the handshake; `None`
    /// once it may send anything. A server refuses anything else from its first byte, without
    /// buffering or parsing it.
    pub(crate) fn expects(&self) -> Option<QueryType> {
        match self.phase {
            Phase::New => Some(QueryType::Validate),
            Phase::NeedAuth => Some(QueryType::AuthBegin),
            Phase::Challenged { .. } => Some(QueryType::AuthProof),
            Phase::Ready => None,
        }
    }

    /// Handles one request: the handshake itself, or a store operation once it is done.
    pub(crate) fn on_request(
        &mut self,
        req: Request,
        state: &mut State,
        secret: Option<&Secret>,
        out: &mut Outbox,
    ) -> Result<(), Refusal> {
        match (&self.phase, req) {
            (Phase::New, Request::Validate { magic }) => {
                if magic != wire::VALIDATION_MAGIC {
                    return Err(Refusal::BadMagic(magic));
                }
                self.phase = if secret.is_some() && !self.trusted { Phase::NeedAuth } else { Phase::Ready };
                Ok(())
            }
            (Phase::New, req) => Err(Refusal::NotValidated(req.query_type())),
            // A trusted peer that holds the secret authenticates all the same, as any client does.
            (Phase::NeedAuth | Phase::Ready, Request::AuthBegin { client_nonce }) if secret.is_some() => {
                let secret = secret.ok_or(Refusal::NoSecret)?;
                let server_nonce = auth::nonce().map_err(Refusal::Random)?;
                let mut bytes = Vec::with_capacity(2 * (8 + wire::NONCE_LEN));
                wire::put_bytes(&mut bytes, &server_nonce);
                wire::put_bytes(&mut bytes, &secret.proof(Role::Server, &client_nonce, &server_nonce));
                out.push((self.conn, small(bytes)));
                self.phase = Phase::Challenged { client_nonce, server_nonce };
                Ok(())
            }
            (Phase::Challenged { client_nonce, server_nonce }, Request::AuthProof { proof }) => {
                let secret = secret.ok_or(Refusal::NoSecret)?;
                if !secret.verify(Role::Client, client_nonce, server_nonce, &proof) {
                    return Err(Refusal::BadProof);
                }
                let t = stream_transcript(client_nonce, server_nonce);
                self.keys = Some(Box::new(secret.link_keys(STREAM_KEYS, &t, Side::Server)));
                self.phase = Phase::Ready;
                out.push((self.conn, small(reply::u8(0))));
                Ok(())
            }
            (Phase::NeedAuth | Phase::Challenged { .. }, req) => Err(Refusal::Unauthenticated(req.query_type())),
            (Phase::Ready, Request::AuthBegin { .. }) => Err(Refusal::NoSecret),
            (Phase::Ready, req) => state.handle(self.conn, req, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    /// Replies as whole byte strings.
    fn flat(out: Outbox) -> Vec<(ConnId, Vec<u8>)> {
        out.into_iter().map(|(c, chunks)| (c, chunks.concat())).collect()
    }

    fn run(state: &mut State, conn: ConnId, req: Request) -> Vec<(ConnId, Vec<u8>)> {
        let mut out = Vec::new();
        state.handle(conn, req, &mut out).unwrap();
        flat(out)
    }

    #[test]
    fn wait_is_answered_when_the_last_key_arrives() {
        let mut s = State::default();
        assert!(run(&mut s, 1, Request::Wait { keys: vec![k("a"), k("b")] }).is_empty());
        assert!(run(&mut s, 2, Request::Set { key: k("a"), value: k("1") }).is_empty());
        let out = run(&mut s, 2, Request::Set { key: k("b"), value: k("2") });
        assert_eq!(out, vec![(1, vec![wire::STOP_WAITING])]);
        // Nothing stray later.
        assert!(run(&mut s, 2, Request::Set { key: k("b"), value: k("3") }).is_empty());
    }

    #[test]
    fn cancelled_wait_sends_nothing_later() {
        let mut s = State::default();
        assert!(run(&mut s, 1, Request::Wait { keys: vec![k("x")] }).is_empty());
        assert_eq!(run(&mut s, 1, Request::CancelWait), vec![(1, vec![wire::WAIT_CANCELED])]);
        assert!(run(&mut s, 2, Request::Set { key: k("x"), value: k("1") }).is_empty());
        assert!(s.waiting.is_empty() && s.waits.is_empty());
    }

    #[test]
    fn disconnect_drops_wait_state() {
        let mut s = State::default();
        run(&mut s, 1, Request::Wait { keys: vec![k("x"), k("y")] });
        s.disconnect(1);
        assert!(s.waiting.is_empty() && s.waits.is_empty());
    }

    #[test]
    fn compare_set_four_cases() {
        let mut s = State::default();
        let cs = |s: &mut State, e: &str, d: &str| {
            run(s, 1, Request::CompareSet { key: k("c"), expected: k(e), desired: k(d) })
        };
        assert_eq!(cs(&mut s, "x", "y"), vec![(1, reply::bytes(b"x"))], "absent, non-empty expected");
        assert!(!s.present(b"c"));
        assert_eq!(cs(&mut s, "", "v1"), vec![(1, reply::bytes(b"v1"))], "absent, empty expected");
        assert_eq!(cs(&mut s, "nope", "v2"), vec![(1, reply::bytes(b"v1"))], "mismatch");
        assert_eq!(cs(&mut s, "v1", "v2"), vec![(1, reply::bytes(b"v2"))], "match");
    }

    #[test]
    fn add_is_ascii_and_refuses_non_integers() {
        let mut s = State::default();
        assert_eq!(run(&mut s, 1, Request::Add { key: k("n"), delta: 7 }), vec![(1, reply::i64(7))]);
        assert_eq!(run(&mut s, 1, Request::Add { key: k("n"), delta: -10 }), vec![(1, reply::i64(-3))]);
        assert_eq!(s.value(b"n"), Some(&b"-3"[..]));
        run(&mut s, 1, Request::Set { key: k("t"), value: k("text") });
        let mut out: Outbox = Vec::new();
        assert!(matches!(
            s.handle(1, Request::Add { key: k("t"), delta: 1 }, &mut out),
            Err(Refusal::NotAnInteger { .. })
        ));
        run(&mut s, 1, Request::Set { key: k("m"), value: i64::MAX.to_string().into_bytes() });
        assert!(matches!(s.handle(1, Request::Add { key: k("m"), delta: 1 }, &mut out), Err(Refusal::Overflow { .. })));
    }

    #[test]
    fn replies_share_values_and_are_bounded() {
        let mut s = State::default();
        let big = vec![7u8; 8 << 20];
        run(&mut s, 1, Request::Set { key: k("big"), value: big.clone() });
        // A GET's reply holds the stored value itself, not a copy.
        let mut out = Vec::new();
        s.handle(1, Request::Get { key: k("big") }, &mut out).unwrap();
        let stored = s.kv.get(&k("big")).unwrap().as_ptr();
        assert_eq!(out[0].1[1].as_ptr(), stored, "the reply shares the stored bytes");
        // A MULTI_GET whose reply would be 8 GiB is refused before anything is built.
        let keys = vec![k("big"); 1000];
        let mut out = Vec::new();
        let e = s.handle(1, Request::MultiGet { keys }, &mut out).unwrap_err();
        assert!(matches!(e, Refusal::ReplyTooLong { .. }), "{e}");
        assert!(out.is_empty());
        // Seven fit in 64 MiB.
        let keys = vec![k("big"); 7];
        assert_eq!(run(&mut s, 1, Request::MultiGet { keys })[0].1.len(), 7 * (8 + (8 << 20)));
        // APPEND is held to the value limit.
        let e = s.handle(1, Request::Append { key: k("big"), value: vec![1] }, &mut out).unwrap_err();
        assert!(matches!(e, Refusal::AppendTooLong { .. }), "{e}");
        run(&mut s, 1, Request::Append { key: k("small"), value: k("ab") });
        run(&mut s, 1, Request::Append { key: k("small"), value: k("cd") });
        assert_eq!(s.value(b"small"), Some(&b"abcd"[..]));
    }

    #[test]
    fn barrier_releases_everyone_on_the_last_arrival() {
        let mut s = State::default();
        let b = || Request::Barrier { key: k("bk"), world_size: 3 };
        assert!(run(&mut s, 1, b()).is_empty());
        assert!(run(&mut s, 2, b()).is_empty());
        let mut out = run(&mut s, 3, b());
        out.sort();
        assert_eq!(out, vec![(1, vec![0]), (2, vec![0]), (3, vec![0])]);
        assert_eq!(s.value(b"bk"), Some(&b"3"[..]));
    }

    #[test]
    fn queue_push_wakes_one_waiter() {
        let mut s = State::default();
        run(&mut s, 1, Request::Wait { keys: vec![k("q")] });
        run(&mut s, 2, Request::Wait { keys: vec![k("q")] });
        let out = run(&mut s, 3, Request::QueuePush { key: k("q"), value: k("x") });
        assert_eq!(out, vec![(1, vec![0])]);
        assert_eq!(
            run(&mut s, 1, Request::QueuePop { key: k("q") }),
            vec![(1, {
                let mut b = reply::i64(1);
                wire::put_bytes(&mut b, b"x");
                b
            })]
        );
        assert_eq!(run(&mut s, 1, Request::QueuePop { key: k("q") }), vec![(1, reply::i64(0))]);
    }

    #[test]
    fn session_requires_validate_then_auth() {
        let secret = Secret::new("s3cret").unwrap();
        let mut state = State::default();
        let mut out = Vec::new();

        let mut s = Session::new(1, false);
        assert!(matches!(s.on_request(Request::GetNumKeys, &mut state, None, &mut out), Err(Refusal::NotValidated(_))));

        let mut s = Session::new(1, false);
        assert!(matches!(
            s.on_request(Request::Validate { magic: 1 }, &mut state, None, &mut out),
            Err(Refusal::BadMagic(1))
        ));

        // With a secret, a torch client's PING after VALIDATE is refused.
        let mut s = Session::new(1, false);
        let validate = || Request::Validate { magic: wire::VALIDATION_MAGIC };
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        assert!(matches!(
            s.on_request(Request::Ping { nonce: 5 }, &mut state, Some(&secret), &mut out),
            Err(Refusal::Unauthenticated(QueryType::Ping))
        ));

        // The full handshake.
        let mut s = Session::new(2, false);
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        let cn = vec![9u8; 32];
        out.clear();
        s.on_request(Request::AuthBegin { client_nonce: cn.clone() }, &mut state, Some(&secret), &mut out).unwrap();
        let (_, challenge) = &flat(out.clone())[0];
        let sn = &challenge[8..40];
        assert!(secret.verify(Role::Server, &cn, sn, &challenge[48..]));
        let proof = secret.proof(Role::Client, &cn, sn).to_vec();
        out.clear();
        s.on_request(Request::AuthProof { proof }, &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(flat(out.clone()), vec![(2, vec![0])]);
        s.on_request(Request::Set { key: k("a"), value: k("b") }, &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(state.value(b"a"), Some(&b"b"[..]));

        // A trusted peer needs no proof, and may still give one.
        let mut s = Session::new(4, true);
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(s.expects(), None);
        s.on_request(Request::Ping { nonce: 5 }, &mut state, Some(&secret), &mut out).unwrap();
        out.clear();
        s.on_request(Request::AuthBegin { client_nonce: vec![1; 32] }, &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(s.expects(), Some(QueryType::AuthProof));

        // A wrong proof closes the connection.
        let mut s = Session::new(3, false);
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        s.on_request(Request::AuthBegin { client_nonce: cn }, &mut state, Some(&secret), &mut out).unwrap();
        assert!(matches!(
            s.on_request(Request::AuthProof { proof: vec![0; 32] }, &mut state, Some(&secret), &mut out),
            Err(Refusal::BadProof)
        ));
    }
}
