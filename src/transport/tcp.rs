//! The `tcp` backend: works between any two hosts.
//!
//! ```text
//!   initiator                                       target
//!   caller ──small──▶ flow 0 socket ───────────────▶ serve thread (per flow): check key,
//!   caller ──large──▶ sender thread (per flow) ────▶   liveness, bounds, permission; recv the
//!                                                      payload straight into registered memory,
//!   receiver thread (per flow) ◀── ACK / DATA / ERROR ── or send DATA straight from it
//! ```
//!
//! - Many requests may be in flight per endpoint; each carries an id, and replies complete
//!   them in any order. Large requests are striped over `flows` connections in chunks, so the
//!   two ends' cores share the work; small ones are written by the caller itself, with no
//!   hand-off to another thread.
//! - No staging copies: the target receives writes into registered memory and sends reads
//!   from it; the initiator sends from and receives into its registered memory.
//! - A refused request (unknown, stale or read-only descriptor, out of bounds) fails only that
//!   request, with the reason; a malformed frame closes only its connection.
//! - A dead peer fails every pending transfer: its sockets close (or TCP keepalive and
//!   `TCP_USER_TIMEOUT` give up on a peer that vanished), and the receiver fails whatever is
//!   outstanding.
//! - The URL carries an address peers can reach: the `host` option or
//!   `SYMMEM_TRANSPORT_TCP_HOST` (default 127.0.0.1); wildcards are refused.

use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, mpsc};
use std::time::{Duration, Instant};

use super::{Backend, Direction, Options, Registration, Request};
use crate::error::{Error, Result};
use crate::symm::signal::{self, Patience};
use crate::wire::tcp::{ATOMIC_BUSY, Atomic, HANDSHAKE_LEN, HEADER_LEN, Handshake, Header, MAX_ERROR_LEN, Op};

/// Environment variable: default number of connections per endpoint.
pub const FLOWS_ENV: &str = "SYMMEM_TRANSPORT_TCP_FLOWS";
/// Environment variable: the address peers reach this endpoint at.
pub const HOST_ENV: &str = "SYMMEM_TRANSPORT_TCP_HOST";
/// Environment variable: the largest chunk of a striped request, in bytes.
pub const CHUNK_ENV: &str = "SYMMEM_TRANSPORT_TCP_CHUNK_SIZE";

/// Requests up to this size go whole on one flow, written by the caller.
const INLINE: usize = 64 * 1024;
/// Requests up to this size are not striped.
const STRIPE_MIN: usize = 1 << 20;
/// The largest chunk a server accepts; larger frames are protocol violations.
const MAX_CHUNK: u64 = 64 << 20;
/// The most flows a server accepts from one peer.
const MAX_FLOWS: u32 = 64;

#[derive(Clone, Debug)]
struct TcpOptions {
    flows: usize,
    host: String,
    chunk: usize,
    timeout: Duration,
}

fn parse_opt<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim().parse().map_err(|_| Error::InvalidArgument(format!("tcp transport option {name}={v:?} is not valid")))
}

impl TcpOptions {
    fn from(o: &Options) -> Result<TcpOptions> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut t = TcpOptions {
            flows: env(FLOWS_ENV).map(|v| parse_opt(FLOWS_ENV, &v)).transpose()?.unwrap_or(4),
            host: env(HOST_ENV).unwrap_or_else(|| "127.0.0.1".into()),
            chunk: env(CHUNK_ENV).map(|v| parse_opt(CHUNK_ENV, &v)).transpose()?.unwrap_or(1 << 20),
            timeout: Duration::from_secs(30),
        };
        for (k, v) in o {
            match k.as_str() {
                "flows" | "num_flows" => t.flows = parse_opt(k, v)?,
                "host" => t.host = v.clone(),
                "chunk_size" => t.chunk = parse_opt(k, v)?,
                "timeout" => {
                    let secs: f64 = parse_opt(k, v)?;
                    t.timeout = Duration::try_from_secs_f64(secs).map_err(|_| {
                        Error::InvalidArgument(format!("tcp transport option timeout={v:?} is not valid"))
                    })?;
                }
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "unknown tcp transport option {other:?} (known: flows, host, chunk_size, timeout)"
                    )));
                }
            }
        }
        if t.flows == 0
            || t.flows > MAX_FLOWS as usize
            || t.chunk == 0
            || t.chunk as u64 > MAX_CHUNK
            || t.timeout.is_zero()
        {
            return Err(Error::InvalidArgument(format!(
                "flows must be 1..={MAX_FLOWS}, chunk_size 1..={MAX_CHUNK}, and timeout positive"
            )));
        }
        let bare = t.host.trim_start_matches('[').trim_end_matches(']');
        if matches!(bare, "0.0.0.0" | "::" | "") {
            return Err(Error::InvalidArgument("host must be an address peers can connect to".into()));
        }
        Ok(t)
    }
}

/// The `tcp` backend.
pub struct TcpBackend {
    inner: Arc<Inner>,
}

struct Inner {
    opts: TcpOptions,
    token: [u8; 16],
    table: RwLock<HashMap<u64, Arc<Registration>>>,
    bound: Mutex<Option<(Vec<u8>, TcpListener)>>,
    /// Clones of served sockets, so `shutdown` can end their threads; removed when they end.
    served: Mutex<HashMap<u64, TcpStream>>,
    next_served: AtomicU64,
    client: Mutex<Option<Arc<Client>>>,
    closed: AtomicBool,
}

impl TcpBackend {
    /// A backend with `options` (`flows`, `host`, `chunk_size`, `timeout` in seconds).
    pub fn new(options: &Options) -> Result<TcpBackend> {
        let mut token = [0u8; 16];
        getrandom::fill(&mut token).map_err(|e| Error::io("draw an endpoint token", std::io::Error::other(e)))?;
        Ok(TcpBackend {
            inner: Arc::new(Inner {
                opts: TcpOptions::from(options)?,
                token,
                table: RwLock::new(HashMap::new()),
                bound: Mutex::new(None),
                served: Mutex::new(HashMap::new()),
                next_served: AtomicU64::new(0),
                client: Mutex::new(None),
                closed: AtomicBool::new(false),
            }),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `tcp://host:port?flows=N&token=HEX`.
struct Url {
    addr: String,
    token: [u8; 16],
}

fn parse_url(url: &[u8]) -> Result<Url> {
    let bad = || Error::InvalidArgument(format!("invalid tcp transport URL {:?}", String::from_utf8_lossy(url)));
    let s = std::str::from_utf8(url).map_err(|_| bad())?;
    let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
    let (addr, query) = rest.split_once('?').ok_or_else(bad)?;
    let mut token = None;
    for kv in query.split('&') {
        let (k, v) = kv.split_once('=').ok_or_else(bad)?;
        match k {
            "token" => token = Some(unhex(v).ok_or_else(bad)?),
            "flows" => {
                let _: u32 = v.parse().map_err(|_| bad())?;
            }
            _ => {}
        }
    }
    let _: SocketAddr = addr.parse().map_err(|_| bad())?;
    Ok(Url { addr: addr.to_string(), token: token.ok_or_else(bad)? })
}

fn tune(s: &TcpStream, timeout: Duration) {
    use rustix::net::sockopt;
    let _ = s.set_nodelay(true);
    let _ = sockopt::set_socket_keepalive(s, true);
    let _ = sockopt::set_tcp_keepidle(s, Duration::from_secs(5).min(timeout));
    let _ = sockopt::set_tcp_keepintvl(s, Duration::from_secs(1));
    let _ = sockopt::set_tcp_keepcnt(s, 5);
    // Unacknowledged data older than the timeout fails the connection.
    let _ = sockopt::set_tcp_user_timeout(s, timeout.as_millis().min(u32::MAX as u128) as u32);
}

impl Backend for TcpBackend {
    fn name(&self) -> &str {
        "tcp"
    }

    fn bind(&self, _timeout: Duration) -> Result<Vec<u8>> {
        let mut bound = lock(&self.inner.bound);
        if let Some((url, _)) = &*bound {
            return Ok(url.clone());
        }
        let host = &self.inner.opts.host;
        let listener = TcpListener::bind((host.trim_start_matches('[').trim_end_matches(']'), 0))
            .map_err(|e| Error::io(format!("bind tcp transport to {host}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("read the tcp transport's address", e))?;
        let url = format!("tcp://{addr}?flows={}&token={}", self.inner.opts.flows, hex(&self.inner.token)).into_bytes();
        let accept = listener.try_clone().map_err(|e| Error::io("clone the tcp transport listener", e))?;
        let inner = self.inner.clone();
        std::thread::Builder::new()
            .name("symmem-tcp-accept".into())
            .spawn(move || accept_loop(inner, accept))
            .map_err(|e| Error::io("start the tcp transport accept thread", e))?;
        *bound = Some((url.clone(), listener));
        Ok(url)
    }

    fn connect(&self, url: &[u8], timeout: Duration) -> Result<()> {
        let url = parse_url(url)?;
        let client = Client::connect(&url, &self.inner.opts, &self.inner.token, timeout)?;
        *lock(&self.inner.client) = Some(client);
        Ok(())
    }

    fn connected(&self) -> bool {
        lock(&self.inner.client).as_ref().is_some_and(|c| c.alive.load(Ordering::Acquire))
    }

    fn expose(&self, reg: &Arc<Registration>) -> Result<()> {
        self.inner.table.write().unwrap_or_else(|p| p.into_inner()).insert(reg.id, reg.clone());
        Ok(())
    }

    fn withdraw(&self, reg: &Registration) {
        self.inner.table.write().unwrap_or_else(|p| p.into_inner()).remove(&reg.id);
    }

    fn submit(&self, req: Request) -> Result<()> {
        let client = lock(&self.inner.client).clone();
        match client {
            Some(c) => c.submit(req),
            None => Err(Error::InvalidArgument("tcp transport is not connected".into())),
        }
    }

    fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::Release);
        if let Some((_, l)) = lock(&self.inner.bound).take() {
            // Wakes the accept thread, which then sees `closed`.
            let _ = rustix::net::shutdown(&l, rustix::net::Shutdown::Read);
        }
        for (_, s) in lock(&self.inner.served).drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(c) = lock(&self.inner.client).take() {
            c.fail("the transport was closed".into());
        }
        self.inner.table.write().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn default_timeout(&self) -> Duration {
        self.inner.opts.timeout
    }

    fn disconnect_reason(&self) -> Option<String> {
        let c = lock(&self.inner.client).clone()?;
        c.why.get().cloned()
    }
}

fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    for conn in listener.incoming() {
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = conn else {
            // EMFILE and the like: back off rather than spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let inner = inner.clone();
        let _ = std::thread::Builder::new().name("symmem-tcp-serve".into()).spawn(move || {
            let id = inner.next_served.fetch_add(1, Ordering::Relaxed);
            if let Ok(clone) = stream.try_clone() {
                lock(&inner.served).insert(id, clone);
            }
            if inner.closed.load(Ordering::Acquire) {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            if let Err(e) = serve(&inner, &stream) {
                tracing::debug!("tcp transport: closing a served connection: {e}");
            }
            // Close for real: the clone kept for `shutdown` would otherwise hold it open.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            lock(&inner.served).remove(&id);
        });
    }
}

/// Serves one flow: requests in, replies out, until the peer closes or breaks the protocol.
fn serve(inner: &Inner, mut s: &TcpStream) -> std::io::Result<()> {
    tune(s, inner.opts.timeout);
    s.set_read_timeout(Some(inner.opts.timeout))?;
    let mut hs = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut hs)?;
    let accepted = match Handshake::decode(&hs) {
        Ok(h) => h.server_token == inner.token && h.flows >= 1 && h.flows <= MAX_FLOWS && h.flow < h.flows,
        Err(_) => false,
    };
    s.write_all(&[u8::from(!accepted)])?;
    if !accepted {
        return Err(std::io::Error::other("refused a handshake (wrong token or flow numbers)"));
    }
    s.set_read_timeout(None)?;
    let mut hdr = [0u8; HEADER_LEN];
    loop {
        match s.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let h = Header::decode(&hdr).map_err(std::io::Error::other)?;
        if h.length > MAX_CHUNK {
            return Err(std::io::Error::other(format!("frame of {} bytes exceeds {MAX_CHUNK}", h.length)));
        }
        let write = match h.op {
            Op::Write => true,
            Op::Read => false,
            Op::Atomic => {
                atomic(inner, s, &h)?;
                continue;
            }
            other => return Err(std::io::Error::other(format!("unexpected {other:?} frame from the initiator"))),
        };
        let reg = inner.table.read().unwrap_or_else(|p| p.into_inner()).get(&h.buffer).cloned();
        let access = match reg {
            Some(r) => r.check_access(&h.key, h.remote_offset, h.length, write).map(|()| r),
            None => Err("unknown remote buffer".to_string()),
        };
        match access {
            Ok(reg) => {
                let at = reg.ptr().wrapping_add(h.remote_offset as usize);
                let len = h.length as usize;
                if write {
                    // SAFETY: check_access put [offset, offset+len) inside the registration,
                    // whose storage `reg` keeps alive. The owner promised not to touch memory
                    // exposed to peers while transfers run (the transport contract), so this
                    // thread has the bytes to itself.
                    let dst = unsafe { std::slice::from_raw_parts_mut(at, len) };
                    s.read_exact(dst)?;
                    reply(s, &h, Op::Ack, &[])?;
                } else {
                    // SAFETY: as above; the bytes are only read.
                    let src = unsafe { std::slice::from_raw_parts(at.cast_const(), len) };
                    reply(s, &h, Op::Data, src)?;
                }
            }
            Err(msg) => {
                if write {
                    drain(s, h.length)?;
                }
                let m = msg.as_bytes();
                reply(s, &h, Op::Error, &m[..m.len().min(MAX_ERROR_LEN as usize)])?;
            }
        }
    }
}

/// Performs an ATOMIC request on a registered word and answers it.
fn atomic(inner: &Inner, s: &TcpStream, h: &Header) -> std::io::Result<()> {
    let refuse = |msg: &str| reply(s, h, Op::Error, &msg.as_bytes()[..msg.len().min(MAX_ERROR_LEN as usize)]);
    let Some(op) = Atomic::from_byte(h.status) else {
        return refuse(&format!("unknown remote atomic {}", h.status));
    };
    if h.length != op.width() || !h.remote_offset.is_multiple_of(op.width()) {
        return refuse(&format!("a {op:?} acts on an aligned {}-byte word", op.width()));
    }
    let reg = inner.table.read().unwrap_or_else(|p| p.into_inner()).get(&h.buffer).cloned();
    let reg = match reg {
        Some(r) => match r.check_access(&h.key, h.remote_offset, h.length, true) {
            Ok(()) => r,
            Err(msg) => return refuse(&msg),
        },
        None => return refuse("unknown remote buffer"),
    };
    let at = reg.ptr().wrapping_add(h.remote_offset as usize);
    if !(at as usize).is_multiple_of(op.width() as usize) {
        return refuse("the word is not aligned in memory");
    }
    let busy = match op {
        Atomic::SlotPut => {
            // SAFETY: check_access put the 4 bytes inside the live registration, which `reg`
            // keeps alive, and `at` is 4-aligned (checked); peers touch signal slots only
            // atomically, so viewing them as an AtomicU32 is sound.
            let slot = unsafe { &*at.cast::<AtomicU32>() };
            // One attempt, no waiting: a busy slot is the initiator's to retry, so this
            // thread never blocks on a peer.
            let now = Patience { spin: Duration::ZERO, yield_for: Duration::ZERO, deadline: Instant::now() };
            match signal::put(slot, &now) {
                Ok(()) => false,
                Err(signal::Failure::TimedOut) => true,
                Err(signal::Failure::Corrupt(v)) => {
                    return refuse(&format!("the signal slot holds {v}, which the signal protocol never writes"));
                }
            }
        }
        Atomic::Set32 => {
            // SAFETY: as above, for an aligned 4-byte word.
            let w = unsafe { &*at.cast::<AtomicU32>() };
            // Release: pairs with the Acquire load of whoever polls the word, after the
            // initiator's earlier writes on this link (acknowledged before it sent this).
            w.store(h.cookie as u32, Ordering::Release);
            crate::sys::futex::wake(w);
            false
        }
        Atomic::Set64 => {
            // SAFETY: as above, for an aligned 8-byte word.
            let w = unsafe { &*at.cast::<AtomicU64>() };
            // Release: pairs with the Acquire load of the word's poller (see Set32).
            w.store(h.cookie, Ordering::Release);
            false
        }
    };
    let ack = Header { op: Op::Ack, status: if busy { ATOMIC_BUSY } else { 0 }, ..*h };
    write_frame(s, &ack, &[])
}

fn drain(mut s: &TcpStream, mut n: u64) -> std::io::Result<()> {
    let mut sink = [0u8; 64 * 1024];
    while n > 0 {
        let k = (n as usize).min(sink.len());
        s.read_exact(&mut sink[..k])?;
        n -= k as u64;
    }
    Ok(())
}

fn reply(s: &TcpStream, req: &Header, op: Op, payload: &[u8]) -> std::io::Result<()> {
    let h = Header { op, status: 0, length: if op == Op::Ack { req.length } else { payload.len() as u64 }, ..*req };
    write_frame(s, &h, payload)
}

/// Writes a header and its payload with as few system calls as possible.
fn write_frame(mut s: &TcpStream, h: &Header, payload: &[u8]) -> std::io::Result<()> {
    let head = h.encode();
    let (mut a, mut b): (&[u8], &[u8]) = (&head, payload);
    while !a.is_empty() || !b.is_empty() {
        let n = s.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// One transfer in flight: its request and how many chunks remain.
struct Pending {
    req: Request,
    remaining: AtomicUsize,
    error: Mutex<Option<String>>,
}

impl Pending {
    fn chunk_done(&self, error: Option<String>) -> bool {
        if let Some(e) = error {
            lock(&self.error).get_or_insert(e);
        }
        // AcqRel: the last chunk sees every earlier chunk's bytes and error.
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }
}

struct Job {
    header: Header,
    pending: Arc<Pending>,
}

struct Flow {
    writer: Mutex<TcpStream>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

struct Client {
    flows: Vec<Flow>,
    pending: Mutex<HashMap<u64, Arc<Pending>>>,
    next: AtomicU64,
    rr: AtomicUsize,
    alive: AtomicBool,
    why: OnceLock<String>,
    chunk: usize,
}

impl Client {
    fn connect(url: &Url, opts: &TcpOptions, token: &[u8; 16], timeout: Duration) -> Result<Arc<Client>> {
        let addr = url
            .addr
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolve {}", url.addr), e))?
            .next()
            .ok_or_else(|| Error::InvalidArgument(format!("{} resolves to no address", url.addr)))?;
        let mut socks = Vec::with_capacity(opts.flows);
        for flow in 0..opts.flows {
            let mut s = TcpStream::connect_timeout(&addr, timeout)
                .map_err(|e| Error::io(format!("connect tcp transport flow {flow} to {addr}"), e))?;
            tune(&s, opts.timeout);
            let hs = Handshake {
                server_token: url.token,
                client_token: *token,
                flow: flow as u32,
                flows: opts.flows as u32,
            };
            s.set_read_timeout(Some(timeout)).map_err(|e| Error::io("set a socket timeout", e))?;
            s.write_all(&hs.encode()).map_err(|e| Error::io(format!("send handshake to {addr}"), e))?;
            let mut status = [1u8];
            s.read_exact(&mut status).map_err(|e| Error::io(format!("read handshake reply from {addr}"), e))?;
            if status[0] != 0 {
                return Err(Error::InvalidArgument(format!(
                    "the tcp transport at {addr} refused the connection (stale URL or wrong token)"
                )));
            }
            s.set_read_timeout(None).map_err(|e| Error::io("clear a socket timeout", e))?;
            socks.push(s);
        }
        let mut flows = Vec::with_capacity(socks.len());
        let mut readers = Vec::with_capacity(socks.len());
        let mut queues = Vec::with_capacity(socks.len());
        for s in socks {
            let r = s.try_clone().map_err(|e| Error::io("clone a socket", e))?;
            let (tx, rx) = mpsc::channel::<Job>();
            flows.push(Flow { writer: Mutex::new(s), jobs: Mutex::new(Some(tx)) });
            readers.push(r);
            queues.push(rx);
        }
        let client = Arc::new(Client {
            flows,
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            rr: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            why: OnceLock::new(),
            chunk: opts.chunk,
        });
        for (i, (r, rx)) in readers.into_iter().zip(queues).enumerate() {
            let c = client.clone();
            std::thread::Builder::new()
                .name("symmem-tcp-recv".into())
                .spawn(move || c.receive(r))
                .map_err(|e| Error::io("start a tcp transport receiver", e))?;
            let c = client.clone();
            std::thread::Builder::new()
                .name("symmem-tcp-send".into())
                .spawn(move || c.send_loop(i, rx))
                .map_err(|e| Error::io("start a tcp transport sender", e))?;
        }
        Ok(client)
    }

    /// Splits a request into (flow, local offset, length) chunks of at most `chunk` bytes:
    /// whole on flow 0 up to `INLINE`, whole on one flow (round-robin) below `STRIPE_MIN`, else
    /// one contiguous stripe per flow.
    fn plan(&self, len: usize) -> Vec<(usize, usize, usize)> {
        let f = self.flows.len();
        let mut out = Vec::new();
        let mut cut = |flow: usize, start: usize, end: usize| {
            let mut at = start;
            loop {
                let n = (end - at).min(self.chunk);
                out.push((flow, at, n));
                at += n;
                if at >= end {
                    break;
                }
            }
        };
        if len <= INLINE {
            // Small requests all take flow 0, so those one thread sends on one link reach the
            // target in order: a write and then a remote atomic need no wait in between.
            cut(0, 0, len);
        } else if len < STRIPE_MIN || f == 1 {
            cut(self.rr.fetch_add(1, Ordering::Relaxed) % f, 0, len);
        } else {
            for i in 0..f {
                cut(i, len * i / f, len * (i + 1) / f);
            }
        }
        out
    }

    fn submit(&self, req: Request) -> Result<()> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(self.lost());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let chunks = self.plan(req.len);
        let (op, status, operand) = match req.direction {
            Direction::Write => (Op::Write, 0, None),
            Direction::Read => (Op::Read, 0, None),
            Direction::Atomic(a, v) => (Op::Atomic, a as u8, Some(v)),
        };
        let (buffer, key, base) = (req.remote.buffer_id, req.remote.access_key, req.remote.offset);
        // Requests that carry no payload (reads, atomics) are sent on the caller's thread
        // whatever their length: 64 bytes per chunk, no hand-off to a sender thread.
        let inline = req.len <= INLINE || op != Op::Write;
        let pending = Arc::new(Pending { req, remaining: AtomicUsize::new(chunks.len()), error: Mutex::new(None) });
        lock(&self.pending).insert(id, pending.clone());
        // A failure that raced with the insertion would never complete this request.
        if !self.alive.load(Ordering::Acquire) {
            lock(&self.pending).remove(&id);
            return Err(self.lost());
        }
        for (flow, at, n) in chunks {
            let header = Header {
                op,
                status,
                request: id,
                // An atomic's operand travels in the cookie (it has no local bytes to place).
                cookie: operand.unwrap_or(at as u64),
                buffer,
                key,
                remote_offset: base + at as u64,
                length: n as u64,
            };
            if inline {
                if let Err(e) = self.send(flow, &header, &pending) {
                    self.fail(format!("send to the peer: {e}"));
                }
            } else {
                let tx = lock(&self.flows[flow].jobs).clone();
                let sent = tx.is_some_and(|tx| tx.send(Job { header, pending: pending.clone() }).is_ok());
                if !sent {
                    self.fail("the transport was closed".into());
                }
            }
        }
        Ok(())
    }

    fn send(&self, flow: usize, h: &Header, p: &Pending) -> std::io::Result<()> {
        let payload: &[u8] = if h.op == Op::Write && h.length > 0 {
            // SAFETY: the chunk lies inside the local view, inside the registration that the
            // pending request (and so `p`) keeps alive; the bytes are only read.
            unsafe {
                std::slice::from_raw_parts(p.req.local_ptr().add(h.cookie as usize).cast_const(), h.length as usize)
            }
        } else {
            &[]
        };
        let w = lock(&self.flows[flow].writer);
        write_frame(&w, h, payload)
    }

    fn send_loop(&self, flow: usize, jobs: mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            if !self.alive.load(Ordering::Acquire) {
                return;
            }
            if let Err(e) = self.send(flow, &job.header, &job.pending) {
                self.fail(format!("send to the peer: {e}"));
                return;
            }
        }
    }

    fn receive(&self, mut s: TcpStream) {
        let why = match self.receive_loop(&mut s) {
            Ok(()) => "the peer closed the connection".to_string(),
            Err(e) => e.to_string(),
        };
        self.fail(why);
    }

    fn receive_loop(&self, s: &mut TcpStream) -> std::io::Result<()> {
        let mut hdr = [0u8; HEADER_LEN];
        loop {
            match s.read_exact(&mut hdr) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
            if !self.alive.load(Ordering::Acquire) {
                return Ok(());
            }
            let h = Header::decode(&hdr).map_err(std::io::Error::other)?;
            let p = lock(&self.pending)
                .get(&h.request)
                .cloned()
                .ok_or_else(|| std::io::Error::other(format!("reply to unknown request {}", h.request)))?;
            let error = match h.op {
                Op::Ack if h.status == ATOMIC_BUSY && matches!(p.req.direction, Direction::Atomic(..)) => {
                    Some(super::ATOMIC_BUSY.to_string())
                }
                Op::Ack => None,
                Op::Data => {
                    let (at, n) = (h.cookie as usize, h.length as usize);
                    if p.req.direction != Direction::Read || at.checked_add(n).is_none_or(|end| end > p.req.len) {
                        return Err(std::io::Error::other("invalid read response"));
                    }
                    // SAFETY: [at, at+n) lies inside the local mutable view (checked above),
                    // inside the registration the pending request keeps alive; the caller
                    // promised not to touch a read's destination until it completes.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.req.local_ptr().add(at), n) };
                    s.read_exact(dst)?;
                    None
                }
                Op::Error => {
                    if h.length > MAX_ERROR_LEN {
                        return Err(std::io::Error::other("oversized error message"));
                    }
                    let mut msg = vec![0u8; h.length as usize];
                    s.read_exact(&mut msg)?;
                    Some(format!("the peer refused it: {}", String::from_utf8_lossy(&msg)))
                }
                other => return Err(std::io::Error::other(format!("unexpected {other:?} frame from the target"))),
            };
            if p.chunk_done(error) {
                lock(&self.pending).remove(&h.request);
                let e = lock(&p.error).take();
                p.req.complete(e.map_or(Ok(()), Err));
            }
        }
    }

    #[cold]
    fn lost(&self) -> Error {
        Error::Transfer(format!(
            "tcp transport is not connected: {}",
            self.why.get().map_or("the connection was lost", String::as_str)
        ))
    }

    /// Marks the connection dead and fails everything pending.
    fn fail(&self, why: String) {
        let _ = self.why.set(why);
        self.alive.store(false, Ordering::Release);
        for f in &self.flows {
            lock(&f.jobs).take();
            let _ = lock(&f.writer).shutdown(std::net::Shutdown::Both);
        }
        let pending: Vec<Arc<Pending>> = lock(&self.pending).drain().map(|(_, p)| p).collect();
        let why = self.why.get().cloned().unwrap_or_default();
        for p in pending {
            p.req.complete(Err(format!("connection to the peer lost: {why}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        let o = |pairs: &[(&str, &str)]| {
            TcpOptions::from(&pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
        };
        assert!(o(&[]).is_ok());
        assert!(o(&[("host", "0.0.0.0")]).unwrap_err().to_string().contains("peers can connect to"));
        assert!(o(&[("host", "::")]).is_err());
        assert!(o(&[("flows", "0")]).is_err());
        assert!(o(&[("chunk_size", "x")]).is_err());
        assert!(o(&[("bogus", "1")]).unwrap_err().to_string().contains("bogus"));
        assert_eq!(o(&[("timeout", "1.5")]).unwrap().timeout, Duration::from_millis(1500));
    }

    #[test]
    fn urls_are_parsed_strictly() {
        let good = b"tcp://127.0.0.1:5000?flows=2&token=000102030405060708090a0b0c0d0e0f";
        assert_eq!(parse_url(good).unwrap().token[15], 15);
        for bad in
            [&b"udp://1.2.3.4:5?token=00"[..], b"tcp://nohost?token=00", b"tcp://127.0.0.1:5000?flows=2", b"\xff"]
        {
            assert!(parse_url(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
