//! The TCP store server: a thin tokio driver around [`State`](super::state::State).
//!
//! Each connection is one tokio task (thousands of clients need no thread each). A task reads
//! bytes, frames and decodes whole requests, applies them to the shared state under a short lock
//! and hands every reply to the outgoing queue of the connection it is for, so a SET wakes
//! waiters on other connections at once. A connection that sends bytes that break the protocol
//! is closed; everyone else is unaffected.
//!
//! What one connection can make the server hold or compute is bounded:
//! - before the handshake is complete (VALIDATE, then authentication when the store has a
//!   secret) a connection may send only the next handshake message: anything else is refused
//!   from its first byte, at most a few dozen bytes are read at a time, and the handshake must
//!   be done within [`ServerOptions::handshake_timeout`]; past [`ServerOptions::max_pending`]
//!   such connections, the oldest is closed;
//! - a request is framed once as it arrives ([`Framer`]) and is at most
//!   [`Limits::max_message`] long; once its first byte has arrived it must be whole within
//!   [`ServerOptions::request_timeout`];
//! - replies share the stored values instead of copying them, and are written out whenever a
//!   megabyte of them is queued, before more requests are read: a client that pipelines
//!   requests without reading the replies stalls only itself;
//! - closed connections are logged at most ten lines a second.
//!
//! The soft limit on open files is raised to the hard limit at start.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::store::auth::Secret;
use crate::store::state::{Chunks, ConnId, Outbox, Session, State, reply_len};
use crate::wire::seal::{Keys, Opener, RECORD_MAX, Sealer};
use crate::wire::store::{Framer, Limits, Request};

/// How a server is configured.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Require clients to prove they hold this secret before any operation.
    pub secret: Option<Secret>,
    /// Size limits on keys, values, key counts, messages and replies.
    pub limits: Limits,
    /// How long a new connection has to complete the handshake (10 s).
    pub handshake_timeout: Duration,
    /// How long a request may take to arrive once its first byte has (30 s).
    pub request_timeout: Duration,
    /// The most connections in the handshake at once; a new one closes the oldest (1024).
    pub max_pending: usize,
    /// Whether a process of this user on this host (in this network namespace, per its
    /// socket's credentials) may skip authentication: it could read the secret from the ranks
    /// anyway, and PyTorch's clients, which cannot authenticate, then work under `symmem run`
    /// (true). Without a secret, such peers of other users are refused either way.
    pub trust_local_user: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            secret: None,
            limits: Limits::SERVER,
            handshake_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_pending: 1024,
            trust_local_user: true,
        }
    }
}

/// A running store server. Dropping it stops the server and closes every connection.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    options: ServerOptions,
    log: Mutex<LogLimit>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("limits", &self.options.limits).finish_non_exhaustive()
    }
}

struct Inner {
    state: State,
    conns: HashMap<ConnId, mpsc::UnboundedSender<Chunks>>,
    /// Connections in the handshake, oldest first, each with the signal that closes it.
    pending: VecDeque<(ConnId, Arc<Notify>)>,
    next_conn: ConnId,
}

/// The most bytes read at a time before the handshake is complete: more than its longest
/// message (AUTH_BEGIN, 41 bytes).
const HANDSHAKE_READ: usize = 64;
/// Queued reply bytes past which a connection writes them out before reading more requests.
const FLUSH_AT: usize = 1 << 20;

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves it from a dedicated thread.
    ///
    /// One thread with a single-threaded runtime serves every connection: the thread woken by
    /// epoll is the one that runs the request, so a round trip costs one wakeup rather than
    /// hops between a multi-threaded runtime's workers (measured: 8 µs against 8 to 70 µs).
    pub fn start(addr: &str, options: ServerOptions) -> Result<StoreServer> {
        crate::sys::raise_fd_limit();
        let (stop, stopped) = watch::channel(false);
        let inner =
            Inner { state: State::new(options.limits), conns: HashMap::new(), pending: VecDeque::new(), next_conn: 0 };
        let shared = Arc::new(Shared { inner: Mutex::new(inner), options, log: Mutex::new(LogLimit::default()) });
        let (ready, bound) = std::sync::mpsc::channel();
        let (a, sh) = (addr.to_string(), shared.clone());
        std::thread::Builder::new()
            .name("symmem-store".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match TcpListener::bind(&a).await.and_then(|l| l.local_addr().map(|at| (l, at))) {
                        Ok((l, at)) => {
                            let _ = ready.send(Ok(at));
                            l
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    accept_loop(listener, sh, stopped).await;
                });
            })
            .map_err(|e| Error::io("start the store server thread", e))?;
        let local = bound
            .recv()
            .map_err(|_| {
                Error::io(format!("bind store server to {addr}"), std::io::Error::other("server thread died"))
            })?
            .map_err(|e| Error::io(format!("bind store server to {addr}"), e))?;
        tracing::debug!(%local, "store server listening");
        Ok(StoreServer { addr: local, stop, shared })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The number of client connections currently open.
    pub fn connections(&self) -> usize {
        lock(&self.shared.inner).conns.len()
    }

    /// Stops accepting and closes every connection.
    pub fn stop(&self) {
        // send_replace never fails, even with no receivers left.
        self.stop.send_replace(true);
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding this lock would be a bug in State; the state is still usable
    // (every operation leaves it consistent before it can panic), so keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// At most ten log lines a second about closed connections, so a flood of bad clients can
/// neither flood the log nor, through a log that is not drained, stall the server.
#[derive(Default)]
struct LogLimit {
    window: Option<std::time::Instant>,
    lines: u32,
    suppressed: u64,
}

impl Shared {
    fn closing(&self, peer: SocketAddr, why: &str) {
        let mut l = lock(&self.log);
        let now = std::time::Instant::now();
        if l.window.is_none_or(|w| now.duration_since(w) >= Duration::from_secs(1)) {
            if l.suppressed > 0 {
                tracing::warn!("store: {} more connections closed (log limited to 10 lines a second)", l.suppressed);
            }
            *l = LogLimit { window: Some(now), lines: 0, suppressed: 0 };
        }
        if l.lines < 10 {
            l.lines += 1;
            tracing::warn!(%peer, "store: closing connection: {why}");
        } else {
            l.suppressed += 1;
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let evict = Arc::new(Notify::new());
                    let id = {
                        let mut inner = lock(&shared.inner);
                        inner.next_conn += 1;
                        let id = inner.next_conn;
                        if inner.pending.len() >= shared.options.max_pending
                            && let Some((_, oldest)) = inner.pending.pop_front()
                        {
                            oldest.notify_one();
                        }
                        inner.pending.push_back((id, evict.clone()));
                        id
                    };
                    tokio::spawn(serve_conn(stream, peer, id, shared.clone(), stopped.clone(), evict));
                }
                Err(e) => {
                    // Usually EMFILE: out of descriptors. Back off instead of spinning.
                    tracing::warn!("store server accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
}

/// Why a connection's read loop ended.
enum End {
    /// The peer closed, the server stopped, or a write failed: nothing to log.
    Quiet,
    /// The server closed it, for this reason.
    Refused(String),
}

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    id: ConnId,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
    evict: Arc<Notify>,
) {
    let _ = stream.set_nodelay(true);
    let o = &shared.options;
    // Peer credentials: a process on this host is trusted if it is this user's, and refused
    // outright by a store without a secret if it is another user's, or if whose it is cannot
    // be established (it closed at once: its bytes, already queued, are never read).
    use crate::sys::peercred::{Owner, tcp_peer};
    let owner = stream.local_addr().map_or(Owner::Unknown, |l| tcp_peer(l, peer));
    let mine = rustix::process::geteuid().as_raw();
    let trusted = o.trust_local_user && owner == Owner::Local(mine);
    let refused = match owner {
        Owner::Local(uid) if uid != mine && o.secret.is_none() => {
            Some(format!("a store without a secret serves no other user (this connection is uid {uid}'s)"))
        }
        Owner::Unknown => Some(
            "a connection from this host whose owner cannot be established (no process holds its socket any more)"
                .to_string(),
        ),
        _ => None,
    };
    if let Some(why) = refused {
        shared.closing(peer, &why);
        lock(&shared.inner).pending.retain(|(p, _)| *p != id);
        return;
    }
    let (mut rd, mut wr) = stream.into_split();
    // Replies for this connection produced by other connections (a SET that completes this
    // connection's WAIT) arrive here; this connection's own replies are queued in `out`.
    let (tx, mut rx) = mpsc::unbounded_channel::<Chunks>();
    lock(&shared.inner).conns.insert(id, tx);

    let accepted = Instant::now();
    let session = Session::new(id, trusted);
    let mut c = Conn {
        id,
        session,
        buf: Vec::new(),
        framer: Framer::new(),
        out: Outgoing::default(),
        raw: Vec::new(),
        opener: None,
    };
    // When the first byte of the request now partly in `buf` arrived.
    let mut started: Option<Instant> = None;
    // Whether this connection is still on the list of those in the handshake.
    let mut pending = true;
    let end = loop {
        let ready = c.session.expects().is_none();
        let after = |t: Instant, d| Instant::from_std(crate::sync::deadline_from(t.into_std(), d));
        let deadline = if ready {
            started.map(|t| after(t, o.request_timeout))
        } else {
            Some(after(accepted, o.handshake_timeout))
        };
        let room = if ready { 64 * 1024 } else { HANDSHAKE_READ };
        let read = tokio::select! {
            _ = stopped.changed() => break End::Quiet,
            _ = evict.notified(), if !ready => {
                break End::Refused("too many connections in the handshake; closed the oldest".into());
            }
            woken = rx.recv() => {
                let Some(chunks) = woken else { break End::Quiet };
                c.out.push(chunks);
                if c.out.flush(&mut wr).await.is_err() {
                    break End::Quiet;
                }
                continue;
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(accepted)), if deadline.is_some() => {
                break End::Refused(if ready {
                    format!("a request did not arrive whole within {:?}", o.request_timeout)
                } else {
                    format!("no handshake within {:?}", o.handshake_timeout)
                });
            }
            n = read_some(&mut rd, c.inbox(), room) => n,
        };
        match read {
            Ok(0) | Err(_) => break End::Quiet,
            Ok(_) => {}
        }
        let before = c.buf.len();
        if let Err(why) = c.open() {
            break End::Refused(why);
        }
        let served = loop {
            let served = c.serve(&shared);
            // Replies already earned are sent even when the connection is then refused.
            if c.out.flush(&mut wr).await.is_err() {
                break Err(None);
            }
            // The answer to an accepted proof went in the clear; everything after is sealed.
            let served = served.and_then(|more| c.start_sealing().map(|()| more));
            match served {
                Ok(true) => continue,
                Ok(false) => break Ok(()),
                Err(why) => break Err(Some(why)),
            }
        };
        match served {
            Ok(()) => {}
            Err(None) => break End::Quiet,
            Err(Some(why)) => break End::Refused(why),
        }
        // A request that started in this read (or still arriving) is timed from its first byte.
        started = match (c.buf.is_empty(), c.buf.len() < before) {
            (true, _) => None,
            (false, true) => Some(Instant::now()),
            (false, false) => started.or(Some(Instant::now())),
        };
        if pending && c.session.expects().is_none() {
            pending = false;
            lock(&shared.inner).pending.retain(|(p, _)| *p != id);
        }
    };

    if let End::Refused(why) = end {
        shared.closing(peer, &why);
    }
    {
        let mut inner = lock(&shared.inner);
        inner.state.disconnect(id);
        inner.conns.remove(&id);
        inner.pending.retain(|(p, _)| *p != id);
    }
    let _ = wr.shutdown().await;
}

/// Reads what arrives into `buf`, at most `room` bytes.
async fn read_some(rd: &mut tokio::net::tcp::OwnedReadHalf, buf: &mut Vec<u8>, room: usize) -> std::io::Result<usize> {
    buf.reserve(room);
    let mut limited = (&mut *rd).take(room as u64);
    limited.read_buf(buf).await
}

/// One connection's protocol state.
struct Conn {
    id: ConnId,
    session: Session,
    /// Bytes received and not yet served: at most one partial request after serving.
    buf: Vec<u8>,
    framer: Framer,
    out: Outgoing,
    /// Sealed bytes received and not yet opened (a record still arriving), once the client
    /// authenticated with the secret.
    raw: Vec<u8>,
    /// Opens the client's sealed stream, once it authenticated with the secret.
    opener: Option<Opener>,
}

impl Conn {
    /// Where bytes read from the socket go: the sealed bytes, once the stream is sealed.
    fn inbox(&mut self) -> &mut Vec<u8> {
        if self.opener.is_some() { &mut self.raw } else { &mut self.buf }
    }

    /// Opens the whole records received, for serving: a record that fails to open closes the
    /// connection (someone between the client and the store, or not the job's client).
    fn open(&mut self) -> std::result::Result<(), String> {
        let Some(o) = &mut self.opener else { return Ok(()) };
        o.open_stream(&mut self.raw, &mut self.buf).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Once the client's proof was accepted (and its answer written in the clear), seals
    /// everything after: replies leave sealed, and the bytes that followed the proof are the
    /// first of the client's sealed stream.
    fn start_sealing(&mut self) -> std::result::Result<(), String> {
        let Some(keys) = self.session.take_keys() else { return Ok(()) };
        let Keys { sealer, opener } = *keys;
        self.out.sealer = Some(sealer);
        self.opener = Some(opener);
        self.raw = std::mem::take(&mut self.buf);
        self.framer = Framer::new();
        self.open()
    }

    /// Serves the whole requests in `buf`. Returns whether it stopped early to let the replies
    /// be written (more whole requests may be waiting), or why the connection must close.
    fn serve(&mut self, shared: &Shared) -> std::result::Result<bool, String> {
        let limits = &shared.options.limits;
        let mut start = 0;
        let result = loop {
            let rest = &self.buf[start..];
            let Some(&first) = rest.first() else { break Ok(false) };
            if let Some(q) = self.session.expects()
                && first != q as u8
            {
                break Err(format!("byte 0x{first:02x} where the handshake expects {q}"));
            }
            let len = match self.framer.advance(rest, limits) {
                Ok(Some(len)) => len,
                Ok(None) => break Ok(false),
                Err(e) => break Err(e.to_string()),
            };
            let req = match Request::decode(&rest[..len], limits) {
                Ok(Some((req, _))) => req,
                // The framer found `len` whole bytes, so decoding them cannot ask for more.
                Ok(None) => break Err("a framed request did not decode".into()),
                Err(e) => break Err(e.to_string()),
            };
            start += len;
            self.framer = Framer::new();
            let mut out: Outbox = Vec::new();
            let mut inner = lock(&shared.inner);
            let inner = &mut *inner;
            if let Err(e) = self.session.on_request(req, &mut inner.state, shared.options.secret.as_ref(), &mut out) {
                break Err(e.to_string());
            }
            for (conn, chunks) in out {
                if conn == self.id {
                    self.out.push(chunks);
                } else if let Some(tx) = inner.conns.get(&conn) {
                    // A send fails only if that connection is closing; its replies are moot.
                    let _ = tx.send(chunks);
                }
            }
            // The proof was accepted: what follows it is sealed, for `start_sealing`.
            if self.out.len >= FLUSH_AT || self.session.sealing() {
                break Ok(true);
            }
        };
        self.buf.drain(..start);
        result
    }
}

/// Replies waiting to be written, in pieces.
#[derive(Default)]
struct Outgoing {
    chunks: VecDeque<Bytes>,
    len: usize,
    /// Seals what leaves, once the client authenticated with the secret: the pieces are
    /// sealed as they are written, a few records at a time, so a queued reply still shares the
    /// stored values it carries.
    sealer: Option<Sealer>,
    /// Sealed bytes, written from `at`.
    wire: Vec<u8>,
    at: usize,
}

/// Plain bytes sealed per system call.
const SEAL_AHEAD: usize = RECORD_MAX;

impl Outgoing {
    fn push(&mut self, c: Chunks) {
        self.len += reply_len(&c);
        self.chunks.extend(c.into_iter().filter(|b| !b.is_empty()));
    }

    /// Writes everything queued, with as few system calls as the pieces allow.
    async fn flush(&mut self, wr: &mut OwnedWriteHalf) -> std::io::Result<()> {
        if self.sealer.is_some() {
            return self.flush_sealed(wr).await;
        }
        while !self.chunks.is_empty() {
            let slices: Vec<IoSlice<'_>> = self.chunks.iter().take(64).map(|b| IoSlice::new(b)).collect();
            let mut n = wr.write_vectored(&slices).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.len = self.len.saturating_sub(n);
            while n > 0 {
                let Some(front) = self.chunks.front_mut() else { break };
                if n >= front.len() {
                    n -= front.len();
                    self.chunks.pop_front();
                } else {
                    front.advance(n);
                    n = 0;
                }
            }
        }
        self.len = 0;
        Ok(())
    }

    /// [`Outgoing::flush`] on a sealed stream: the pieces are gathered into records of at most
    /// [`RECORD_MAX`] bytes, sealed a few at a time, and written.
    async fn flush_sealed(&mut self, wr: &mut OwnedWriteHalf) -> std::io::Result<()> {
        let mut plain = Vec::new();
        loop {
            if self.at == self.wire.len() {
                self.wire.clear();
                self.at = 0;
                let Some(sealer) = &mut self.sealer else { break };
                let mut taken = 0;
                while taken < SEAL_AHEAD && !self.chunks.is_empty() {
                    plain.clear();
                    while plain.len() < RECORD_MAX {
                        let Some(front) = self.chunks.front_mut() else { break };
                        let n = front.len().min(RECORD_MAX - plain.len());
                        plain.extend_from_slice(&front[..n]);
                        front.advance(n);
                        if front.is_empty() {
                            self.chunks.pop_front();
                        }
                    }
                    taken += plain.len();
                    sealer.seal_stream(&mut self.wire, &plain).map_err(std::io::Error::other)?;
                }
                self.len = self.len.saturating_sub(taken);
                if self.wire.is_empty() {
                    break;
                }
            }
            let n = wr.write(&self.wire[self.at..]).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.at += n;
        }
        self.len = 0;
        Ok(())
    }
}
