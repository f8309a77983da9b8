//! The store client: [`AsyncStoreClient`] speaks the protocol over one connection, and
//! [`TcpStore`] wraps it as a synchronous, thread-safe [`Store`].
//!
//! Like torch's client, user keys go on the wire with a leading `/`, so `set("x")` here and
//! `store.set("x")` in Python touch the same key; `get` is WAIT then GET; and a timed-out wait
//! sends CANCEL_WAIT and consumes the reply (and a racing STOP_WAITING), so the connection stays
//! usable after a timeout.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::auth::{self, Role, Secret};
use crate::store::state::{STREAM_KEYS, stream_transcript};
use crate::wire::seal::{Keys, Side};
use crate::wire::store::{self as wire, DecodeError, Limits, QueryType, Reply, ReplyShape, Request};

/// The default timeout of store operations and of connecting (torch's is also 300 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How a client connects and behaves.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bounds connecting (with retries while the server is not up yet) and every operation
    /// that has no explicit timeout.
    pub timeout: Duration,
    /// Authenticate with this secret; required when the server has one.
    pub secret: Option<Secret>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions { timeout: DEFAULT_TIMEOUT, secret: None }
    }
}

impl ClientOptions {
    /// Options from the environment: `SYMMEM_STORE_TIMEOUT` (seconds) and `SYMMEM_STORE_SECRET`.
    pub fn from_env() -> Result<ClientOptions> {
        Ok(ClientOptions { timeout: crate::config::store_timeout()?, secret: Secret::from_env() })
    }
}

/// The wire form of a user key: torch's client prefixes every key with `/`.
fn wire_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(b'/');
    k.extend_from_slice(key.as_bytes());
    k
}

/// A byte stream to a store server, with deadlines. The protocol logic of [`StoreClient`] is
/// written once against this trait: [`TokioConn`] drives it on a tokio runtime for async
/// callers; [`BlockingConn`] is a plain blocking socket whose futures complete at once, so
/// synchronous calls cost direct syscalls and no thread hand-offs.
pub trait Conn: Sized {
    /// Makes one connection attempt, failing with `TimedOut` at `deadline`.
    fn connect(addr: &str, deadline: Instant) -> impl Future<Output = io::Result<Self>>;
    /// Waits between connection attempts.
    fn pause(d: Duration) -> impl Future<Output = ()>;
    /// Writes all of `bytes`, failing with `TimedOut` at `deadline`.
    fn write_all(&mut self, bytes: &[u8], deadline: Instant) -> impl Future<Output = io::Result<()>>;
    /// Appends what arrives to `buf` (0 at end of stream), failing with `TimedOut` at `deadline`.
    fn read_some(&mut self, buf: &mut Vec<u8>, deadline: Instant) -> impl Future<Output = io::Result<usize>>;
    /// The peer's address.
    fn peer(&self) -> Option<SocketAddr>;
}

fn timed_out() -> io::Error {
    io::Error::from(io::ErrorKind::TimedOut)
}

/// A store connection on the current tokio runtime.
#[derive(Debug)]
pub struct TokioConn(TcpStream);

impl Conn for TokioConn {
    async fn connect(addr: &str, deadline: Instant) -> io::Result<Self> {
        let s = tokio::time::timeout_at(deadline.into(), TcpStream::connect(addr)).await.map_err(|_| timed_out())??;
        let _ = s.set_nodelay(true);
        Ok(TokioConn(s))
    }

    async fn pause(d: Duration) {
        tokio::time::sleep(d).await;
    }

    async fn write_all(&mut self, bytes: &[u8], deadline: Instant) -> io::Result<()> {
        tokio::time::timeout_at(deadline.into(), self.0.write_all(bytes)).await.map_err(|_| timed_out())?
    }

    async fn read_some(&mut self, buf: &mut Vec<u8>, deadline: Instant) -> io::Result<usize> {
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(64 * 1024);
        }
        tokio::time::timeout_at(deadline.into(), self.0.read_buf(buf)).await.map_err(|_| timed_out())?
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.0.peer_addr().ok()
    }
}

/// A store connection on a blocking socket; its futures never return `Pending`.
#[derive(Debug)]
pub struct BlockingConn(std::net::TcpStream);

fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() { Err(timed_out()) } else { Ok(left) }
}

fn blocking_timeout(e: io::Error) -> io::Error {
    // A socket timeout shows as WouldBlock (EAGAIN) on Linux.
    if e.kind() == io::ErrorKind::WouldBlock { timed_out() } else { e }
}

impl Conn for BlockingConn {
    async fn connect(addr: &str, deadline: Instant) -> io::Result<Self> {
        use std::net::ToSocketAddrs;
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
        for a in addr.to_socket_addrs()? {
            match std::net::TcpStream::connect_timeout(&a, remaining(deadline)?) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(BlockingConn(s));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn pause(d: Duration) {
        std::thread::sleep(d);
    }

    async fn write_all(&mut self, bytes: &[u8], deadline: Instant) -> io::Result<()> {
        use std::io::Write;
        self.0.set_write_timeout(Some(remaining(deadline)?))?;
        self.0.write_all(bytes).map_err(blocking_timeout)
    }

    async fn read_some(&mut self, buf: &mut Vec<u8>, deadline: Instant) -> io::Result<usize> {
        use std::io::Read;
        self.0.set_read_timeout(Some(remaining(deadline)?))?;
        let old = buf.len();
        buf.resize(old + 16 * 1024, 0);
        let r = self.0.read(&mut buf[old..]).map_err(blocking_timeout);
        buf.truncate(old + *r.as_ref().unwrap_or(&0));
        r
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.0.peer_addr().ok()
    }
}

/// A [`StoreClient`] for async callers on a tokio runtime.
pub type AsyncStoreClient = StoreClient<TokioConn>;

/// One connection to a store server. Each method sends one request and waits for its reply;
/// one request is in flight at a time, as with torch's client.
#[derive(Debug)]
pub struct StoreClient<C: Conn> {
    stream: C,
    peer: String,
    buf: Vec<u8>,
    out: Vec<u8>,
    timeout: Duration,
    /// Set when a request timed out with its reply still due: the connection is out of step.
    broken: bool,
    /// The sealed stream, once authenticated with the secret.
    seal: Option<Sealed>,
}

/// A store connection's sealed stream (after authentication with the secret): requests
/// leave sealed, replies are opened before they are decoded.
struct Sealed {
    keys: Keys,
    /// Received bytes not yet opened (a record still arriving).
    raw: Vec<u8>,
    /// Sealed requests being written.
    wire: Vec<u8>,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealed(..)")
    }
}

impl<C: Conn> StoreClient<C> {
    /// Connects to `addr` (`host:port`), retrying while nothing listens yet, and performs the
    /// handshake (VALIDATE, then PING or authentication).
    pub async fn connect(addr: &str, options: &ClientOptions) -> Result<StoreClient<C>> {
        let deadline = crate::sync::deadline(options.timeout);
        let mut backoff = Duration::from_millis(5);
        let stream = loop {
            match C::connect(addr, deadline).await {
                Ok(s) => break s,
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return Err(Error::timeout(format!("the store at {addr} to accept"), options.timeout));
                }
                Err(e) if Instant::now() + backoff < deadline => {
                    tracing::trace!("connect to store at {addr}: {e}; retrying");
                    C::pause(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(Error::io(format!("connect to store at {addr}"), e)),
            }
        };
        let peer = stream.peer().map_or_else(|| addr.to_string(), |a| a.to_string());
        let mut c = StoreClient {
            stream,
            peer,
            buf: Vec::with_capacity(256),
            out: Vec::with_capacity(256),
            timeout: options.timeout,
            broken: false,
            seal: None,
        };
        c.handshake(options.secret.as_ref(), deadline).await?;
        Ok(c)
    }

    async fn handshake(&mut self, secret: Option<&Secret>, deadline: Instant) -> Result<()> {
        self.send(&Request::Validate { magic: wire::VALIDATION_MAGIC }, deadline).await?;
        let Some(secret) = secret else {
            let nonce = std::process::id();
            return match self.call(&Request::Ping { nonce }, deadline).await {
                Ok(Reply::U32(n)) if n == nonce => Ok(()),
                Ok(other) => Err(self.bad_reply("PING", &other)),
                Err(Error::ConnectionClosed { .. }) => Err(Error::Auth {
                    peer: self.peer.clone(),
                    reason: format!(
                        "the store closed the connection after the handshake; it may require a shared secret ({})",
                        crate::config::env::STORE_SECRET
                    ),
                }),
                Err(e) => Err(e),
            };
        };
        let client_nonce = auth::nonce().map_err(|e| Error::io("draw a random nonce", e))?;
        let challenge = self.call(&Request::AuthBegin { client_nonce: client_nonce.to_vec() }, deadline).await;
        let (server_nonce, proof) = match challenge {
            Ok(Reply::AuthChallenge { server_nonce, proof }) => (server_nonce, proof),
            Ok(other) => return Err(self.bad_reply("AUTH_BEGIN", &other)),
            Err(Error::ConnectionClosed { .. }) => {
                return Err(Error::Auth {
                    peer: self.peer.clone(),
                    reason: format!(
                        "the store does not accept authentication: it has no secret, or is PyTorch's (under torchrun, \
                         unset {} and set {} instead, which keys symmem's links and leaves the store alone)",
                        crate::config::env::STORE_SECRET,
                        crate::config::env::JOB_SECRET
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        if !secret.verify(Role::Server, &client_nonce, &server_nonce, &proof) {
            return Err(Error::Auth {
                peer: self.peer.clone(),
                reason: "the store's proof does not match our secret".into(),
            });
        }
        let mine = secret.proof(Role::Client, &client_nonce, &server_nonce).to_vec();
        match self.call(&Request::AuthProof { proof: mine }, deadline).await {
            Ok(Reply::U8(0)) => {
                // Everything after the proof's answer travels sealed.
                let t = stream_transcript(&client_nonce, &server_nonce);
                let keys = secret.link_keys(STREAM_KEYS, &t, Side::Client);
                let raw = std::mem::take(&mut self.buf);
                self.seal = Some(Sealed { keys, raw, wire: Vec::new() });
                self.open().map_err(|e| Error::Auth { peer: self.peer.clone(), reason: e })
            }
            Ok(other) => Err(self.bad_reply("AUTH_PROOF", &other)),
            Err(Error::ConnectionClosed { .. }) => {
                Err(Error::Auth { peer: self.peer.clone(), reason: "the store rejected our secret".into() })
            }
            Err(e) => Err(e),
        }
    }

    /// The server's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sets `key` to `value`.
    pub async fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set { key: wire_key(key), value: value.to_vec() };
        self.send(&req, self.deadline()).await
    }

    /// Waits up to `timeout` for `key` to exist, then returns its value.
    pub async fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout).await?;
        match self.call(&Request::Get { key: wire_key(key) }, self.deadline()).await? {
            Reply::Bytes(v) => Ok(v),
            other => Err(self.bad_reply("GET", &other)),
        }
    }

    /// Adds `delta` to the integer at `key` (absent counts as 0) and returns the new value.
    pub async fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.call_i64(Request::Add { key: wire_key(key), delta }, "ADD").await
    }

    /// Sets `key` to `desired` if it holds `expected` (or is absent and `expected` is empty);
    /// returns the value now stored, with torch's semantics for an absent key.
    pub async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = Request::CompareSet { key: wire_key(key), expected: expected.to_vec(), desired: desired.to_vec() };
        match self.call(&req, self.deadline()).await? {
            Reply::Bytes(v) => Ok(v),
            other => Err(self.bad_reply("COMPARE_SET", &other)),
        }
    }

    /// Waits up to `timeout` until every key exists.
    pub async fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let req = Request::Wait { keys: keys.iter().map(|k| wire_key(k)).collect() };
        let deadline = crate::sync::deadline(timeout);
        self.send(&req, deadline).await?;
        self.finish_wait(keys, deadline, timeout).await
    }

    /// A barrier member's arrival in one round trip: DELETE_KEY of each `forget` key, SET of
    /// `arrive` and WAIT for `all`, written at once; then the deletes' replies and the wait's.
    pub async fn arrive_and_wait(
        &mut self,
        forget: &[&str],
        arrive: &str,
        all: &[&str],
        timeout: Duration,
    ) -> Result<()> {
        let deadline = crate::sync::deadline(timeout);
        let mut reqs: Vec<Request> = forget.iter().map(|k| Request::DeleteKey { key: wire_key(k) }).collect();
        reqs.push(Request::Set { key: wire_key(arrive), value: Vec::new() });
        reqs.push(Request::Wait { keys: all.iter().map(|k| wire_key(k)).collect() });
        self.send_all(&reqs, self.deadline()).await?;
        for _ in forget {
            match self.read_reply(ReplyShape::I64, self.deadline(), "DELETE_KEY").await {
                Ok(Reply::I64(_)) => {}
                Ok(other) => return Err(self.bad_reply("DELETE_KEY", &other)),
                Err(e) => {
                    // The WAIT's reply is still due: the connection is out of step.
                    self.broken = true;
                    return Err(e);
                }
            }
        }
        self.finish_wait(all, deadline, timeout).await
    }

    /// Reads a WAIT's reply; on timeout, cancels the wait.
    async fn finish_wait(&mut self, keys: &[&str], deadline: Instant, timeout: Duration) -> Result<()> {
        match self.read_reply(ReplyShape::U8, deadline, "WAIT").await {
            Ok(Reply::U8(wire::STOP_WAITING)) => Ok(()),
            Ok(other) => Err(self.bad_reply("WAIT", &other)),
            Err(e) if e.is_timeout() => {
                self.cancel_wait().await?;
                Err(Error::timeout(format!("store keys {keys:?} at {}", self.peer), timeout))
            }
            Err(e) => Err(e),
        }
    }

    /// After a wait timed out: CANCEL_WAIT, then consume WAIT_CANCELED, and a STOP_WAITING
    /// that may have raced ahead of it (torch's `doWait`).
    async fn cancel_wait(&mut self) -> Result<()> {
        let deadline = self.deadline();
        let result = async {
            self.send(&Request::CancelWait, deadline).await?;
            let mut byte = self.read_reply(ReplyShape::U8, deadline, "CANCEL_WAIT").await?;
            if byte == Reply::U8(wire::STOP_WAITING) {
                byte = self.read_reply(ReplyShape::U8, deadline, "CANCEL_WAIT").await?;
            }
            if byte != Reply::U8(wire::WAIT_CANCELED) {
                return Err(self.bad_reply("CANCEL_WAIT", &byte));
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            // Out of step with the server: the next call reconnects.
            self.broken = true;
        }
        result
    }

    /// Whether every key exists now; never blocks on the keys.
    pub async fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let req = Request::Check { keys: keys.iter().map(|k| wire_key(k)).collect() };
        match self.call(&req, self.deadline()).await? {
            Reply::U8(wire::READY) => Ok(true),
            Reply::U8(wire::NOT_READY) => Ok(false),
            other => Err(self.bad_reply("CHECK", &other)),
        }
    }

    /// Deletes `key`; returns whether it existed.
    pub async fn delete(&mut self, key: &str) -> Result<bool> {
        Ok(self.call_i64(Request::DeleteKey { key: wire_key(key) }, "DELETE_KEY").await? > 0)
    }

    /// Deletes every key of `keys`: every request in one write, then their replies.
    pub async fn delete_many(&mut self, keys: &[&str]) -> Result<()> {
        let reqs: Vec<Request> = keys.iter().map(|k| Request::DeleteKey { key: wire_key(k) }).collect();
        self.send_all(&reqs, self.deadline()).await?;
        for _ in keys {
            match self.read_reply(ReplyShape::I64, self.deadline(), "DELETE_KEY").await {
                Ok(Reply::I64(_)) => {}
                Ok(other) => return Err(self.bad_reply("DELETE_KEY", &other)),
                Err(e) => {
                    // Replies may still be due: the connection is out of step.
                    self.broken = true;
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The number of keys in the store, of every prefix (as torch counts them).
    pub async fn num_keys(&mut self) -> Result<i64> {
        self.call_i64(Request::GetNumKeys, "GETNUMKEYS").await
    }

    /// Waits up to `timeout` for every key, then returns their values in order.
    pub async fn multi_get(&mut self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout).await?;
        let req = Request::MultiGet { keys: keys.iter().map(|k| wire_key(k)).collect() };
        match self.call(&req, self.deadline()).await? {
            Reply::Values(v) => Ok(v),
            other => Err(self.bad_reply("MULTI_GET", &other)),
        }
    }

    /// Sets several keys in one message.
    pub async fn multi_set(&mut self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let req = Request::MultiSet { pairs: pairs.iter().map(|(k, v)| (wire_key(k), v.to_vec())).collect() };
        self.send(&req, self.deadline()).await
    }

    /// Appends `value` to the value at `key`, creating it if absent.
    pub async fn append(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Append { key: wire_key(key), value: value.to_vec() };
        self.send(&req, self.deadline()).await
    }

    /// The user keys in the store (wire keys with the `/` prefix, stripped; others are hidden,
    /// as torch's `list_keys` does).
    pub async fn list_keys(&mut self) -> Result<Vec<String>> {
        match self.call(&Request::ListKeys, self.deadline()).await? {
            Reply::Keys(keys) => Ok(keys
                .into_iter()
                .filter_map(|k| k.strip_prefix(b"/").map(|k| String::from_utf8_lossy(k).into_owned()))
                .collect()),
            other => Err(self.bad_reply("LIST_KEYS", &other)),
        }
    }

    /// Checks the server is alive; returns the round-trip time.
    pub async fn ping(&mut self) -> Result<Duration> {
        let start = Instant::now();
        let nonce = std::process::id() ^ 0x5a5a_5a5a;
        match self.call(&Request::Ping { nonce }, self.deadline()).await? {
            Reply::U32(n) if n == nonce => Ok(start.elapsed()),
            other => Err(self.bad_reply("PING", &other)),
        }
    }

    fn deadline(&self) -> Instant {
        crate::sync::deadline(self.timeout)
    }

    async fn call_i64(&mut self, req: Request, what: &'static str) -> Result<i64> {
        match self.call(&req, self.deadline()).await? {
            Reply::I64(v) => Ok(v),
            other => Err(self.bad_reply(what, &other)),
        }
    }

    async fn call(&mut self, req: &Request, deadline: Instant) -> Result<Reply> {
        self.send(req, deadline).await?;
        // `call` is used only for requests that have replies.
        let shape =
            req.reply_shape().ok_or_else(|| Error::InvalidArgument(format!("{} has no reply", req.query_type())))?;
        let name = req.query_type();
        match self.read_reply(shape, deadline, name_of(name)).await {
            Err(e) if e.is_timeout() => {
                // The reply may still come and would be taken for the next request's.
                self.broken = true;
                Err(e)
            }
            r => r,
        }
    }

    async fn send(&mut self, req: &Request, deadline: Instant) -> Result<()> {
        self.send_all(std::slice::from_ref(req), deadline).await
    }

    /// Sends requests back to back in one write.
    async fn send_all(&mut self, reqs: &[Request], deadline: Instant) -> Result<()> {
        if self.broken {
            return Err(Error::Closed("store connection (an earlier request timed out; reconnect)"));
        }
        reqs.iter().try_for_each(check_limits)?;
        self.out.clear();
        for req in reqs {
            req.encode(&mut self.out);
        }
        let what = reqs.last().map_or(QueryType::Ping, Request::query_type);
        let bytes = match &mut self.seal {
            None => &self.out,
            Some(s) => {
                s.wire.clear();
                s.keys.sealer.seal_stream(&mut s.wire, &self.out).map_err(|e| Error::InvalidArgument(e.to_string()))?;
                &s.wire
            }
        };
        match self.stream.write_all(bytes, deadline).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                self.broken = true;
                Err(Error::timeout(format!("the store at {} to take {what}", self.peer), self.timeout))
            }
            Err(e) => {
                self.broken = true;
                Err(Error::io(format!("send {what} to store at {}", self.peer), e))
            }
        }
    }

    async fn read_reply(&mut self, shape: ReplyShape, deadline: Instant, what: &str) -> Result<Reply> {
        let started = Instant::now();
        loop {
            match Reply::decode(shape, &self.buf, &Limits::CLIENT) {
                Ok(Some((reply, used))) => {
                    self.buf.drain(..used);
                    return Ok(reply);
                }
                Ok(None) => {}
                Err(source) => {
                    self.broken = true;
                    return Err(Error::Protocol { peer: self.peer.clone(), source: Box::new(source) });
                }
            }
            let inbox = match &mut self.seal {
                None => &mut self.buf,
                Some(s) => &mut s.raw,
            };
            match self.stream.read_some(inbox, deadline).await {
                Ok(0) => {
                    self.broken = true;
                    return Err(Error::ConnectionClosed { peer: self.peer.clone(), during: what.to_string() });
                }
                Ok(_) => {
                    if let Err(why) = self.open() {
                        self.broken = true;
                        return Err(Error::Auth { peer: self.peer.clone(), reason: why });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return Err(Error::timeout(
                        format!("the reply to {what} from the store at {}", self.peer),
                        started.elapsed(),
                    ));
                }
                Err(e) => {
                    self.broken = true;
                    return Err(Error::io(format!("read {what} reply from store at {}", self.peer), e));
                }
            }
        }
    }

    /// Opens the whole sealed records received (when the stream is sealed) into `buf`.
    fn open(&mut self) -> std::result::Result<(), String> {
        let Some(s) = &mut self.seal else { return Ok(()) };
        s.keys.opener.open_stream(&mut s.raw, &mut self.buf).map(|_| ()).map_err(|e| e.to_string())
    }

    #[cold]
    fn bad_reply(&mut self, what: &str, reply: &Reply) -> Error {
        self.broken = true;
        Error::UnexpectedReply { peer: self.peer.clone(), request: what.to_string(), reply: format!("{reply:?}") }
    }
}

fn name_of(q: wire::QueryType) -> &'static str {
    use wire::QueryType::*;
    match q {
        Validate => "VALIDATE",
        Set => "SET",
        CompareSet => "COMPARE_SET",
        Get => "GET",
        Add => "ADD",
        Check => "CHECK",
        Wait => "WAIT",
        GetNumKeys => "GETNUMKEYS",
        DeleteKey => "DELETE_KEY",
        Append => "APPEND",
        MultiGet => "MULTI_GET",
        MultiSet => "MULTI_SET",
        CancelWait => "CANCEL_WAIT",
        Ping => "PING",
        QueuePush => "QUEUE_PUSH",
        QueuePop => "QUEUE_POP",
        QueueLen => "QUEUE_LEN",
        ListKeys => "LIST_KEYS",
        Barrier => "BARRIER",
        AuthBegin => "AUTH_BEGIN",
        AuthProof => "AUTH_PROOF",
    }
}

/// Refuses, before sending, what the server would refuse by closing the connection.
fn check_limits(req: &Request) -> Result<()> {
    let l = Limits::SERVER;
    let key = |k: &Vec<u8>| {
        if k.len() as u64 > l.max_key_len {
            return Err(Error::TooLarge(Box::new(DecodeError::KeyTooLong { len: k.len() as u64, max: l.max_key_len })));
        }
        Ok(())
    };
    let value = |v: &Vec<u8>| {
        if v.len() as u64 > l.max_value_len {
            return Err(Error::TooLarge(Box::new(DecodeError::ValueTooLong {
                len: v.len() as u64,
                max: l.max_value_len,
            })));
        }
        Ok(())
    };
    let count = |n: usize| {
        if n as u64 > l.max_keys {
            return Err(Error::TooLarge(Box::new(DecodeError::TooManyKeys { count: n as u64, max: l.max_keys })));
        }
        Ok(())
    };
    match req {
        Request::Set { key: k, value: v }
        | Request::Append { key: k, value: v }
        | Request::QueuePush { key: k, value: v } => {
            key(k)?;
            value(v)
        }
        Request::CompareSet { key: k, expected, desired } => {
            key(k)?;
            value(expected)?;
            value(desired)
        }
        Request::Get { key: k }
        | Request::Add { key: k, .. }
        | Request::DeleteKey { key: k }
        | Request::QueuePop { key: k }
        | Request::QueueLen { key: k }
        | Request::Barrier { key: k, .. } => key(k),
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
            count(keys.len())?;
            keys.iter().try_for_each(key)
        }
        Request::MultiSet { pairs } => {
            count(pairs.len())?;
            pairs.iter().try_for_each(|(k, v)| {
                key(k)?;
                value(v)
            })
        }
        _ => Ok(()),
    }
}

/// A synchronous, thread-safe client of a TCP store: the [`Store`] that ranks use.
///
/// Calls from several threads are serialized over one connection. A connection that fell out
/// of step (a reply that timed out) is replaced on the next call.
///
/// ```
/// use std::time::Duration;
/// use symmem::store::{ClientOptions, ServerOptions, Store, StoreServer, TcpStore};
///
/// let server = StoreServer::start("127.0.0.1:0", ServerOptions::default())?;
/// let store = TcpStore::connect(&server.local_addr().to_string(), ClientOptions::default())?;
/// store.set("greeting", b"hello")?;
/// assert_eq!(store.get("greeting")?, b"hello");
/// assert_eq!(store.add("counter", 5)?, 5);
/// assert!(store.wait_timeout(&["never"], Duration::from_millis(50)).unwrap_err().is_timeout());
/// # Ok::<(), symmem::Error>(())
/// ```
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    options: ClientOptions,
    conn: Mutex<Option<StoreClient<BlockingConn>>>,
}

impl TcpStore {
    /// Connects to the store at `addr` (`host:port`), retrying until `options.timeout` while
    /// the server is not up yet.
    pub fn connect(addr: &str, options: ClientOptions) -> Result<TcpStore> {
        let conn = futures::executor::block_on(StoreClient::connect(addr, &options))?;
        Ok(TcpStore { addr: addr.to_string(), options, conn: Mutex::new(Some(conn)) })
    }

    /// The server's address, as given to `connect`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Checks that the server answers; returns the round-trip time.
    pub fn ping(&self) -> Result<Duration> {
        self.with(async |c| c.ping().await)
    }

    /// The user keys in the store.
    pub fn list_keys(&self) -> Result<Vec<String>> {
        self.with(async |c| c.list_keys().await)
    }

    fn with<T>(&self, f: impl AsyncFnOnce(&mut StoreClient<BlockingConn>) -> Result<T>) -> Result<T> {
        // A panic inside `f` leaves at worst a broken connection, which is replaced below.
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        // BlockingConn's futures complete without ever returning Pending, so this blocks only
        // in the socket calls themselves.
        futures::executor::block_on(async {
            if guard.as_ref().is_none_or(|c| c.broken) {
                *guard = None;
                *guard = Some(StoreClient::connect(&self.addr, &self.options).await?);
            }
            // Just set above when it was None.
            let conn = guard.as_mut().expect("connection present");
            f(conn).await
        })
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.with(async |c| c.set(key, value).await)
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.with(async |c| c.get(key, timeout).await)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.with(async |c| c.add(key, delta).await)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.with(async |c| c.compare_set(key, expected, desired).await)
    }

    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.with(async |c| c.wait(keys, timeout).await)
    }

    fn arrive_and_wait(&self, forget: &[&str], arrive: &str, all: &[&str], timeout: Duration) -> Result<()> {
        self.with(async |c| c.arrive_and_wait(forget, arrive, all, timeout).await)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.with(async |c| c.check(keys).await)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.with(async |c| c.delete(key).await)
    }

    fn delete_many(&self, keys: &[&str]) -> Result<()> {
        self.with(async |c| c.delete_many(keys).await)
    }

    fn num_keys(&self) -> Result<i64> {
        self.with(async |c| c.num_keys().await)
    }

    fn multi_get_timeout(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.with(async |c| c.multi_get(keys, timeout).await)
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        self.with(async |c| c.multi_set(pairs).await)
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.with(async |c| c.append(key, value).await)
    }

    fn timeout(&self) -> Duration {
        self.options.timeout
    }
}
