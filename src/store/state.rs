//! The store's protocol core: the key-value state and each connection's session, as plain state
//! machines with no I/O (the quinn-proto split). The TCP server feeds them decoded requests and
//! sends the replies they produce; the in-process store uses the same state directly.
//!
//! Semantics follow torch's libuv server (`reference/torch-tcpstore-protocol.md` §3): GET of a
//! missing key answers an empty value, COMPARE_SET and QUEUE_PUSH wake waiters, ADD stores ASCII
//! decimal. Replies may go to other connections than the one that sent the request: a SET wakes
//! every connection whose WAIT it completes.

use std::collections::{HashMap, VecDeque};

use crate::store::auth::{self, Role, Secret};
use crate::wire::store::{self as wire, QueryType, Request, reply};

/// Identifies one client connection of a server.
pub(crate) type ConnId = u64;

/// Replies produced by one request: `(connection, bytes)` in the order they must be sent.
pub(crate) type Outbox = Vec<(ConnId, Vec<u8>)>;

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
#[derive(Default)]
pub(crate) struct State {
    kv: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// For each key, the `(connection, wait id)` pairs waiting for it.
    waiting: HashMap<Vec<u8>, Vec<(ConnId, u64)>>,
    waits: HashMap<ConnId, Pending>,
    next_wait: u64,
}

impl State {
    /// Applies one request from `conn` (which has passed the handshake) and queues its replies.
    pub(crate) fn handle(&mut self, conn: ConnId, req: Request, out: &mut Outbox) -> Result<(), Refusal> {
        match req {
            Request::Set { key, value } => self.set(key, value, out),
            Request::CompareSet { key, expected, desired } => {
                let now = self.compare_set(key, &expected, desired, out);
                out.push((conn, reply::bytes(&now)));
            }
            Request::Get { key } => {
                let value = self.kv.get(&key).map(Vec::as_slice).unwrap_or_default();
                out.push((conn, reply::bytes(value)));
            }
            Request::Add { key, delta } => {
                let v = self.add(key, delta, out)?;
                out.push((conn, reply::i64(v)));
            }
            Request::Check { keys } => {
                let ready = keys.iter().all(|k| self.present(k));
                out.push((conn, reply::u8(if ready { wire::READY } else { wire::NOT_READY })));
            }
            Request::Wait { keys } => self.wait(conn, keys, out),
            Request::GetNumKeys => out.push((conn, reply::i64(self.kv.len() as i64))),
            Request::DeleteKey { key } => {
                let n = i64::from(self.kv.remove(&key).is_some());
                out.push((conn, reply::i64(n)));
            }
            Request::Append { key, value } => self.append(key, &value, out),
            Request::MultiGet { keys } => {
                let mut bytes = Vec::new();
                for k in &keys {
                    wire::put_bytes(&mut bytes, self.kv.get(k).map(Vec::as_slice).unwrap_or_default());
                }
                out.push((conn, bytes));
            }
            Request::MultiSet { pairs } => {
                for (k, v) in pairs {
                    self.set(k, v, out);
                }
            }
            Request::CancelWait => {
                self.cancel(conn);
                out.push((conn, reply::u8(wire::WAIT_CANCELED)));
            }
            Request::Ping { nonce } => out.push((conn, reply::u32(nonce))),
            Request::QueuePush { key, value } => {
                self.queues.entry(key.clone()).or_default().push_back(value);
                self.wake_one(&key, out);
            }
            Request::QueuePop { key } => {
                let queue = self.queues.get_mut(&key);
                let len = queue.as_ref().map_or(0, |q| q.len());
                let mut bytes = reply::i64(len as i64);
                if let Some(front) = queue.and_then(VecDeque::pop_front) {
                    wire::put_bytes(&mut bytes, &front);
                }
                out.push((conn, bytes));
            }
            Request::QueueLen { key } => {
                let len = self.queues.get(&key).map_or(0, VecDeque::len);
                out.push((conn, reply::i64(len as i64)));
            }
            Request::ListKeys => {
                let mut bytes = reply::i64(self.kv.len() as i64);
                for k in self.kv.keys() {
                    wire::put_bytes(&mut bytes, k);
                }
                out.push((conn, bytes));
            }
            Request::Barrier { key, world_size } => {
                // The arrival count does not wake anyone; only the last arrival does (torch).
                let count = self.bump(&key, 1)?;
                self.kv.insert(key.clone(), count.to_string().into_bytes());
                if count >= world_size {
                    out.push((conn, reply::u8(wire::STOP_WAITING)));
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
        self.kv.get(key).map(Vec::as_slice)
    }

    pub(crate) fn len(&self) -> usize {
        self.kv.len()
    }

    pub(crate) fn delete(&mut self, key: &[u8]) -> bool {
        self.kv.remove(key).is_some()
    }

    pub(crate) fn set(&mut self, key: Vec<u8>, value: Vec<u8>, out: &mut Outbox) {
        self.touch(&key, out);
        self.kv.insert(key, value);
    }

    pub(crate) fn append(&mut self, key: Vec<u8>, value: &[u8], out: &mut Outbox) {
        self.touch(&key, out);
        self.kv.entry(key).or_default().extend_from_slice(value);
    }

    /// torch's ADD: absent counts as 0; the value is stored as ASCII decimal.
    pub(crate) fn add(&mut self, key: Vec<u8>, delta: i64, out: &mut Outbox) -> Result<i64, Refusal> {
        let new = self.bump(&key, delta)?;
        self.set(key, new.to_string().into_bytes(), out);
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
    pub(crate) fn compare_set(&mut self, key: Vec<u8>, expected: &[u8], desired: Vec<u8>, out: &mut Outbox) -> Vec<u8> {
        match self.kv.get(&key) {
            None if expected.is_empty() => {
                self.set(key, desired.clone(), out);
                desired
            }
            None => expected.to_vec(),
            Some(current) if current.as_slice() == expected => {
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
            out.push((conn, reply::u8(wire::STOP_WAITING)));
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
            out.push((conn, reply::u8(wire::STOP_WAITING)));
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
}

impl Session {
    pub(crate) fn new(conn: ConnId) -> Session {
        Session { conn, phase: Phase::New }
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
                self.phase = if secret.is_some() { Phase::NeedAuth } else { Phase::Ready };
                Ok(())
            }
            (Phase::New, req) => Err(Refusal::NotValidated(req.query_type())),
            (Phase::NeedAuth, Request::AuthBegin { client_nonce }) => {
                let secret = secret.ok_or(Refusal::NoSecret)?;
                let server_nonce = auth::nonce().map_err(Refusal::Random)?;
                let mut bytes = Vec::with_capacity(2 * (8 + wire::NONCE_LEN));
                wire::put_bytes(&mut bytes, &server_nonce);
                wire::put_bytes(&mut bytes, &secret.proof(Role::Server, &client_nonce, &server_nonce));
                out.push((self.conn, bytes));
                self.phase = Phase::Challenged { client_nonce, server_nonce };
                Ok(())
            }
            (Phase::Challenged { client_nonce, server_nonce }, Request::AuthProof { proof }) => {
                let secret = secret.ok_or(Refusal::NoSecret)?;
                if !secret.verify(Role::Client, client_nonce, server_nonce, &proof) {
                    return Err(Refusal::BadProof);
                }
                self.phase = Phase::Ready;
                out.push((self.conn, reply::u8(0)));
                Ok(())
            }
            (Phase::NeedAuth | Phase::Challenged { .. }, req) => Err(Refusal::Unauthenticated(req.query_type())),
            (Phase::Ready, Request::AuthBegin { .. }) if secret.is_none() => Err(Refusal::NoSecret),
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

    fn run(state: &mut State, conn: ConnId, req: Request) -> Outbox {
        let mut out = Vec::new();
        state.handle(conn, req, &mut out).unwrap();
        out
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
        let mut out = Vec::new();
        assert!(matches!(
            s.handle(1, Request::Add { key: k("t"), delta: 1 }, &mut out),
            Err(Refusal::NotAnInteger { .. })
        ));
        run(&mut s, 1, Request::Set { key: k("m"), value: i64::MAX.to_string().into_bytes() });
        assert!(matches!(s.handle(1, Request::Add { key: k("m"), delta: 1 }, &mut out), Err(Refusal::Overflow { .. })));
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

        let mut s = Session::new(1);
        assert!(matches!(s.on_request(Request::GetNumKeys, &mut state, None, &mut out), Err(Refusal::NotValidated(_))));

        let mut s = Session::new(1);
        assert!(matches!(
            s.on_request(Request::Validate { magic: 1 }, &mut state, None, &mut out),
            Err(Refusal::BadMagic(1))
        ));

        // With a secret, a torch client's PING after VALIDATE is refused.
        let mut s = Session::new(1);
        let validate = || Request::Validate { magic: wire::VALIDATION_MAGIC };
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        assert!(matches!(
            s.on_request(Request::Ping { nonce: 5 }, &mut state, Some(&secret), &mut out),
            Err(Refusal::Unauthenticated(QueryType::Ping))
        ));

        // The full handshake.
        let mut s = Session::new(2);
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        let cn = vec![9u8; 32];
        out.clear();
        s.on_request(Request::AuthBegin { client_nonce: cn.clone() }, &mut state, Some(&secret), &mut out).unwrap();
        let (_, challenge) = &out[0];
        let sn = &challenge[8..40];
        assert!(secret.verify(Role::Server, &cn, sn, &challenge[48..]));
        let proof = secret.proof(Role::Client, &cn, sn).to_vec();
        out.clear();
        s.on_request(Request::AuthProof { proof }, &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(out, vec![(2, vec![0])]);
        s.on_request(Request::Set { key: k("a"), value: k("b") }, &mut state, Some(&secret), &mut out).unwrap();
        assert_eq!(state.value(b"a"), Some(&b"b"[..]));

        // A wrong proof closes the connection.
        let mut s = Session::new(3);
        s.on_request(validate(), &mut state, Some(&secret), &mut out).unwrap();
        s.on_request(Request::AuthBegin { client_nonce: cn }, &mut state, Some(&secret), &mut out).unwrap();
        assert!(matches!(
            s.on_request(Request::AuthProof { proof: vec![0; 32] }, &mut state, Some(&secret), &mut out),
            Err(Refusal::BadProof)
        ));
    }
}
