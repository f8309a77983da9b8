//! The initiator's side of the `tcp` backend: its flows, their queues and threads.
//!
//! ```text
//!   submit ──▶ a stripe of a striped write ──────────────▶ queue, for the flow's sender thread
//!     │ any other frame
//!     └──▶ flow queue empty? ──yes──▶ write what the socket takes now (non-blocking)
//!                     │                          │ the rest
//!                     no ──────────────▶ queue ◀─┘ ──▶ the flow's sender thread, when the
//!                                                        socket has room (poll)
//!   replies: ACK / DATA / ERROR ──▶ completes the Work, read by whoever holds the flow's
//!            reader: a caller waiting on a one-frame request (flow 0) reads while it spins,
//!            else the flow's receiver thread (which polls without holding the reader)
//!   while it spins, that caller also serves what the peer sent this side's own transport
//!   (`listen::serve_arrived`): two ranks waiting on each other's reads wake no thread
//! ```
//!
//! Nothing here waits for a socket on the caller's thread: a full socket (a peer that stopped
//! reading) leaves the rest of a frame queued, and the caller's wait on the Work is what times
//! out. Frames leave a flow in the order they were submitted to it. A waiter reading its own
//! reply spares the hand-off from the receiver thread; the receiver is still woken by the same
//! reply (it polls the socket) and finds it taken.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use rustc_hash::FxHashMap;
use rustix::event::{EventfdFlags, PollFd, PollFlags, poll};

use super::listen::GOODBYE;
use super::{CLIENT_PROOF, INLINE, LINK_KEYS, Looks, ReadAhead, SERVER_PROOF, STRIPE_MIN, TcpOptions, Url, lock, tune};
use crate::error::{Error, Failed, Result, TransferKind};
use crate::transport::work::Progress;
use crate::transport::{Direction, Request};
use crate::wire::seal::{Keys, Opener, RECORD_MAX, Sealer, Side, TAG_LEN};
use crate::wire::tcp::{
    ATOMIC_BUSY, Auth, CHALLENGE_LEN, Challenge, HEADER_LEN, Header, Hello, MAX_ERROR_LEN, Op, POSTED, Refused, sealed,
    transcript,
};

/// One transfer in flight: its request and how many chunks remain.
struct Pending {
    req: Request,
    remaining: AtomicUsize,
    error: Mutex<Option<Failed>>,
}

impl Pending {
    fn chunk_done(&self, error: Option<Failed>) -> bool {
        if let Some(e) = error {
            lock(&self.error).get_or_insert(e);
        }
        // AcqRel: the last chunk sees every earlier chunk's bytes and error.
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }
}

/// One frame to write: its header, and for a write its payload in the local registration
/// (kept alive by the pending request).
struct Frame {
    head: [u8; HEADER_LEN],
    /// The request (none for a fence).
    pending: Option<Arc<Pending>>,
    /// Whether it is posted: done once written.
    posted: bool,
    /// The payload's offset in the request's local view, and its length (0: none).
    at: usize,
    len: usize,
    /// Bytes of header and payload already written.
    done: usize,
}

impl Frame {
    fn payload(&self) -> &[u8] {
        let Some(p) = self.pending.as_ref().filter(|_| self.len > 0) else { return &[] };
        // SAFETY: [at, at+len) lies inside the local view (planned from its length), inside the
        // registration that the pending request, held by this frame, keeps alive; the bytes
        // are only read, and the caller promised not to change a write's source until it
        // completes (a posted write completes only once this frame is written whole).
        unsafe { std::slice::from_raw_parts(p.req.local_ptr().add(self.at).cast_const(), self.len) }
    }
}

/// A flow's socket (non-blocking) and the frames waiting for it, in order.
struct Queue {
    sock: TcpStream,
    frames: VecDeque<Frame>,
    /// The sender thread is to write the frames (set with every notify; cleared when it has
    /// written them all): frames held for a release wait without it.
    kicked: bool,
    /// The flow's sealed records, unless its frames travel exposed.
    seal: Option<SealOut>,
}

/// The most frames one vectored write takes.
const GATHER: usize = 16;

/// Sealed bytes made ready ahead of the socket: frames are sealed (in the queue's order, so
/// their records' numbers are the wire's) until this much waits to be written.
const SEAL_AHEAD: usize = 256 * 1024;

/// A flow's outgoing records: frames are sealed as they are about to leave, in the queue's
/// order, by whoever writes the queue (the caller for small requests, the flow's sender
/// thread for the stripes of large ones, each flow's on its own core).
struct SealOut {
    sealer: Sealer,
    /// Sealed bytes, written from `at`.
    wire: Vec<u8>,
    at: usize,
    /// Frames sealed whole whose last byte is not yet written: where it ends in `wire`.
    sealed: VecDeque<(usize, Frame)>,
}

impl Queue {
    /// Nothing waits to be written.
    fn idle(&self) -> bool {
        self.frames.is_empty() && self.seal.as_ref().is_none_or(|o| o.at == o.wire.len())
    }

    /// Writes the queued frames, several per system call, as far as the socket takes them
    /// now, calling `sent` with each frame written whole; true once nothing waits.
    fn write_queued(&mut self, sent: &dyn Fn(&Frame)) -> std::io::Result<bool> {
        if self.seal.is_some() {
            return self.write_sealed(sent);
        }
        let mut s = &self.sock;
        loop {
            if self.frames.is_empty() {
                return Ok(true);
            }
            let written = {
                let mut slices = [IoSlice::new(&[]); 2 * GATHER];
                let mut k = 0;
                for f in self.frames.iter().take(GATHER) {
                    let payload = f.payload();
                    if f.done < HEADER_LEN {
                        slices[k] = IoSlice::new(&f.head[f.done..]);
                        slices[k + 1] = IoSlice::new(payload);
                    } else {
                        slices[k + 1] = IoSlice::new(&payload[f.done - HEADER_LEN..]);
                    }
                    k += 2;
                }
                s.write_vectored(&slices[..k])
            };
            match written {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(mut n) => {
                    while n > 0 {
                        let Some(f) = self.frames.front_mut() else { break };
                        let left = HEADER_LEN + f.len - f.done;
                        if n < left {
                            f.done += n;
                            break;
                        }
                        n -= left;
                        if let Some(f) = self.frames.pop_front() {
                            sent(&f);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// [`Queue::write_queued`] for a sealed flow: seals the frames ahead of the socket (a
    /// frame's `done` counts its bytes sealed), a header as one record and a payload as records
    /// of at most [`RECORD_MAX`] bytes, and writes the records.
    fn write_sealed(&mut self, sent: &dyn Fn(&Frame)) -> std::io::Result<bool> {
        let Queue { sock, frames, seal: Some(o), .. } = self else { return Ok(true) };
        let sealing = |e| std::io::Error::other(format!("seal a frame: {e}"));
        loop {
            while o.wire.len() - o.at < SEAL_AHEAD {
                let Some(f) = frames.front_mut() else { break };
                if f.done < HEADER_LEN {
                    o.sealer.seal_into(&mut o.wire, &f.head).map_err(sealing)?;
                    f.done = HEADER_LEN;
                } else {
                    let at = f.done - HEADER_LEN;
                    let n = (f.len - at).min(RECORD_MAX);
                    o.sealer.seal_into(&mut o.wire, &f.payload()[at..at + n]).map_err(sealing)?;
                    f.done += n;
                }
                if f.done == HEADER_LEN + f.len
                    && let Some(f) = frames.pop_front()
                {
                    o.sealed.push_back((o.wire.len(), f));
                }
            }
            if o.at == o.wire.len() {
                o.wire.clear();
                o.at = 0;
                return Ok(frames.is_empty());
            }
            match (&*sock).write(&o.wire[o.at..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    o.at += n;
                    while o.sealed.front().is_some_and(|(end, _)| *end <= o.at) {
                        if let Some((_, f)) = o.sealed.pop_front() {
                            sent(&f);
                        }
                    }
                    if o.at == o.wire.len() {
                        o.wire.clear();
                        o.at = 0;
                    } else if o.at >= SEAL_AHEAD {
                        // Keep the buffer small: what is written goes.
                        o.wire.drain(..o.at);
                        for (end, _) in &mut o.sealed {
                            *end -= o.at;
                        }
                        o.at = 0;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Every frame not yet written whole (to fail them).
    fn take_unsent(&mut self) -> Vec<Frame> {
        let mut unsent: Vec<Frame> = Vec::new();
        if let Some(o) = &mut self.seal {
            unsent.extend(o.sealed.drain(..).map(|(_, f)| f));
            o.wire.clear();
            o.at = 0;
        }
        unsent.extend(self.frames.drain(..));
        unsent
    }
}

struct Flow {
    queue: Mutex<Queue>,
    /// Signalled when frames are queued, and when the client fails.
    more: Condvar,
    /// The same socket, to wait for room or replies without a lock.
    poller: TcpStream,
    /// The same socket, for reading replies: whoever holds it (the flow's receiver thread, or
    /// a caller progressing its own small transfer) reads whole frames.
    reader: Mutex<Reader>,
    /// An eventfd that ends the receiver thread's sleep on the socket when a caller starts
    /// reading the flow's replies itself (flow 0), so the thread stands aside, away from it.
    kick: OwnedFd,
    /// The receiver thread sleeps (or is about to) waiting for replies: a caller that starts
    /// reading them wakes it once.
    asleep: AtomicBool,
    /// The receiver thread (tests read its scheduling counts).
    #[cfg(test)]
    tid: std::sync::atomic::AtomicI32,
    /// Its naps aside.
    #[cfg(test)]
    naps: AtomicU64,
}

/// Bytes of replies read ahead: the acknowledgements the peer answered a batch with are read
/// with one system call.
const READ_AHEAD: usize = 4096;

/// A flow's socket for replies, read ahead.
struct Reader {
    sock: TcpStream,
    ahead: ReadAhead,
    /// The flow's sealed records, unless its frames travel exposed.
    open: Option<SealIn>,
}

/// A flow's incoming records: each is received whole into `rec`, opened there, and only
/// then copied to where its bytes go.
struct SealIn {
    opener: Opener,
    rec: Box<[u8]>,
}

impl Reader {
    fn buffered(&self) -> usize {
        self.ahead.buffered()
    }

    fn fill(&mut self) -> std::io::Result<Option<usize>> {
        self.ahead.fill(&self.sock)
    }

    /// The bytes of a reply's header on the wire.
    fn head_len(&self) -> usize {
        HEADER_LEN + if self.open.is_some() { TAG_LEN } else { 0 }
    }

    /// Fills `dst` with the stream's next bytes: those read ahead, then the rest from the
    /// socket, waiting for them; false at a clean end of the stream before the first byte.
    fn read_exact(&mut self, dst: &mut [u8], alive: &AtomicBool) -> std::io::Result<bool> {
        let n = self.ahead.take(dst);
        if n == dst.len() {
            return Ok(true);
        }
        match read_full(&self.sock, &mut dst[n..], alive)? {
            true => Ok(true),
            false if n == 0 => Ok(false),
            false => Err(std::io::ErrorKind::UnexpectedEof.into()),
        }
    }

    /// Reads the next reply's header, waiting for the rest of it (sealed: opens its record);
    /// `None` at a clean end of the stream.
    fn header(&mut self, alive: &AtomicBool) -> std::io::Result<Option<[u8; HEADER_LEN]>> {
        let n = self.head_len();
        let mut wire = [0u8; HEADER_LEN + TAG_LEN];
        if !self.read_exact(&mut wire[..n], alive)? {
            return Ok(None);
        }
        let mut hdr = [0u8; HEADER_LEN];
        match &mut self.open {
            None => hdr.copy_from_slice(&wire[..HEADER_LEN]),
            Some(o) => hdr.copy_from_slice(o.opener.open_in_place(&mut wire[..n]).map_err(std::io::Error::other)?),
        }
        Ok(Some(hdr))
    }

    /// Fills `dst` with a reply's payload, waiting for it (sealed: record by record, each
    /// opened before its bytes are copied to `dst`).
    fn payload(&mut self, dst: &mut [u8], alive: &AtomicBool) -> std::io::Result<()> {
        let Some(mut o) = self.open.take() else {
            return match self.read_exact(dst, alive)? {
                true => Ok(()),
                false => Err(std::io::ErrorKind::UnexpectedEof.into()),
            };
        };
        let mut result = Ok(());
        for part in dst.chunks_mut(RECORD_MAX) {
            let wire = part.len() + TAG_LEN;
            result = match self.read_exact(&mut o.rec[..wire], alive) {
                Ok(true) => o
                    .opener
                    .open_in_place(&mut o.rec[..wire])
                    .map(|p| part.copy_from_slice(p))
                    .map_err(std::io::Error::other),
                Ok(false) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                Err(e) => Err(e),
            };
            if result.is_err() {
                break;
            }
        }
        self.open = Some(o);
        result
    }
}

/// What one attempt to read a reply frame found.
enum Got {
    /// A frame was read and handled.
    Frame,
    /// Nothing to read now (at a frame boundary).
    Empty,
    /// The peer closed the connection (at a frame boundary), or the client failed.
    Closed,
}

pub(super) struct Client {
    flows: Vec<Flow>,
    /// The requests awaiting a reply, by id (the ids are this client's own, sequential).
    /// Posted requests are not here: their frames hold them until written (see `sent`).
    pending: Mutex<FxHashMap<u64, Arc<Pending>>>,
    next: AtomicU64,
    rr: AtomicUsize,
    alive: AtomicBool,
    why: OnceLock<String>,
    chunk: usize,
    /// What a waiter on a one-frame request calls while it spins: reads flow 0's replies.
    progress: Progress,
    /// How many holds are open ([`Client::hold`]): while any is, small requests wait in flow
    /// 0's queue for the last release (or for a waiter) instead of leaving one by one.
    held: AtomicUsize,
    /// A posted request was sent since the last fence began.
    unfenced: AtomicBool,
    /// The highest fence the peer answered.
    fenced: AtomicU64,
    /// When a waiter last read flow 0's replies itself: the flow's receiver thread leaves them
    /// to waiters that look this often.
    looks: Looks,
}

/// Waits until `s` is readable (`IN`) or writable (`OUT`), at most `within`.
fn wait_for(s: &TcpStream, flags: PollFlags, within: Duration) {
    let mut fds = [PollFd::new(s, flags)];
    let t = rustix::time::Timespec { tv_sec: within.as_secs() as i64, tv_nsec: i64::from(within.subsec_nanos()) };
    let _ = poll(&mut fds, Some(&t));
}

/// Reads exactly `buf.len()` bytes from a non-blocking socket, waiting for them as needed;
/// `Ok(false)` at a clean end of stream before the first byte.
fn read_full(mut s: &TcpStream, buf: &mut [u8], alive: &AtomicBool) -> std::io::Result<bool> {
    let mut at = 0;
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) if at == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Acquire: pairs with the Release store in `fail`.
                if !alive.load(Ordering::Acquire) {
                    return Ok(false);
                }
                wait_for(s, PollFlags::IN, Duration::from_secs(1));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Runs one flow's handshake on a blocking socket; the error says why the peer refused. The
/// keys of the flow's sealed records, unless its frames travel exposed.
pub(super) fn handshake(
    s: &mut TcpStream,
    url: &Url,
    opts: &TcpOptions,
    token: &[u8; 16],
    flow: usize,
) -> Result<Option<Keys>> {
    let addr = &url.addr;
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).map_err(|e| Error::io("draw a nonce", std::io::Error::other(e)))?;
    let hello = Hello {
        server_token: url.token,
        client_token: *token,
        flow: flow as u32,
        flows: opts.flows as u32,
        auth: opts.auth(),
        frames: opts.frames,
        nonce,
    };
    s.write_all(&hello.encode()).map_err(|e| Error::io(format!("send a handshake to {addr}"), e))?;
    let mut c = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut c).map_err(|e| Error::io(format!("read the handshake's answer from {addr}"), e))?;
    let refused = |why: String| Error::Auth {
        peer: format!("the tcp transport at {addr}"),
        reason: format!("it refused this connection: {why}"),
    };
    let challenge = Challenge::decode(&c).map_err(|e| refused(e.to_string()))?;
    if let Some(r) = challenge.refused {
        return Err(refused(r.to_string()));
    }
    let t = transcript(&hello, &challenge);
    let (proof, keys) = match (&opts.secret, challenge.auth) {
        (Some(_), Auth::Token) => {
            return Err(Error::Auth {
                peer: format!("the tcp transport at {addr}"),
                reason: "it has no job secret and this process has one; both ends of a link must share \
                         SYMMEM_JOB_SECRET (or SYMMEM_STORE_SECRET), or both use auth=token"
                    .into(),
            });
        }
        (Some(secret), Auth::JobSecret) => {
            if !secret.check(SERVER_PROOF, &[&t], &challenge.proof) {
                return Err(Error::Auth {
                    peer: format!("the tcp transport at {addr}"),
                    reason: "its proof of the job's secret is wrong: it is not of this job".into(),
                });
            }
            let keys = sealed(&hello, &challenge).then(|| secret.link_keys(LINK_KEYS, &t, Side::Client));
            (secret.sign(CLIENT_PROOF, &[&t]), keys)
        }
        // A server requiring the secret refused above; a token-only one needs no proof.
        (None, _) => ([0u8; 32], None),
    };
    s.write_all(&proof).map_err(|e| Error::io(format!("send a proof to {addr}"), e))?;
    let mut verdict = [1u8];
    s.read_exact(&mut verdict).map_err(|e| Error::io(format!("read the handshake's verdict from {addr}"), e))?;
    match Refused::from_byte(verdict[0]) {
        None => Ok(keys),
        Some(r) => Err(refused(r.to_string())),
    }
}

impl Client {
    /// Connects the flows to the transport at `url`. `serve` serves what the peer sent this
    /// side's own transport (what has arrived of its requests), for a waiter to call while it
    /// spins: two ranks waiting on each other's small reads answer them with no thread woken.
    pub(super) fn connect(
        url: &Url,
        opts: &TcpOptions,
        token: &[u8; 16],
        timeout: Duration,
        serve: Progress,
    ) -> Result<Arc<Client>> {
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
            // A server on this host must be this user's: another user's process could be
            // squatting on a port a dead endpoint left.
            if let Ok(local) = s.local_addr()
                && let Err(foreign) = crate::sys::peercred::same_user_or_remote(local, addr)
            {
                return Err(Error::Auth {
                    peer: format!("the tcp transport at {addr}"),
                    reason: format!("refusing to send to it: {foreign}"),
                });
            }
            tune(&s, opts.timeout);
            s.set_read_timeout(Some(timeout)).map_err(|e| Error::io("set a socket timeout", e))?;
            let keys = handshake(&mut s, url, opts, token, flow)?;
            s.set_read_timeout(None).map_err(|e| Error::io("clear a socket timeout", e))?;
            s.set_nonblocking(true).map_err(|e| Error::io("make a socket non-blocking", e))?;
            socks.push((s, keys));
        }
        let mut flows = Vec::with_capacity(socks.len());
        for (s, keys) in socks {
            let (seal, open) = match keys {
                Some(k) => (
                    Some(SealOut { sealer: k.sealer, wire: Vec::new(), at: 0, sealed: VecDeque::new() }),
                    Some(SealIn { opener: k.opener, rec: vec![0u8; RECORD_MAX + TAG_LEN].into_boxed_slice() }),
                ),
                None => (None, None),
            };
            let poller = s.try_clone().map_err(|e| Error::io("clone a socket", e))?;
            let reader = Mutex::new(Reader {
                sock: s.try_clone().map_err(|e| Error::io("clone a socket", e))?,
                ahead: ReadAhead::new(READ_AHEAD),
                open,
            });
            let kick = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| Error::io("create a tcp transport eventfd", e.into()))?;
            flows.push(Flow {
                queue: Mutex::new(Queue { sock: s, frames: VecDeque::new(), kicked: false, seal }),
                more: Condvar::new(),
                poller,
                reader,
                kick,
                asleep: AtomicBool::new(false),
                #[cfg(test)]
                tid: std::sync::atomic::AtomicI32::new(0),
                #[cfg(test)]
                naps: AtomicU64::new(0),
            });
        }
        let client = Arc::new_cyclic(|me: &std::sync::Weak<Client>| {
            let me = me.clone();
            Client {
                flows,
                pending: Mutex::new(FxHashMap::default()),
                next: AtomicU64::new(1),
                rr: AtomicUsize::new(0),
                alive: AtomicBool::new(true),
                why: OnceLock::new(),
                chunk: opts.chunk,
                held: AtomicUsize::new(0),
                unfenced: AtomicBool::new(false),
                fenced: AtomicU64::new(0),
                looks: Looks::new(),
                // Weak: a Work outliving its transport must not keep the client alive.
                progress: Arc::new(move || {
                    if let Some(c) = me.upgrade() {
                        c.progress(0);
                    }
                    serve();
                }),
            }
        });
        for i in 0..client.flows.len() {
            let c = client.clone();
            std::thread::Builder::new()
                .name("symmem-tcp-recv".into())
                .spawn(move || c.receive(i))
                .map_err(|e| Error::io("start a tcp transport receiver", e))?;
            let c = client.clone();
            std::thread::Builder::new()
                .name("symmem-tcp-send".into())
                .spawn(move || c.send_loop(i))
                .map_err(|e| Error::io("start a tcp transport sender", e))?;
        }
        Ok(client)
    }

    /// Whether the connection is alive.
    pub(super) fn alive(&self) -> bool {
        // Acquire: pairs with the Release store in `fail`.
        self.alive.load(Ordering::Acquire)
    }

    /// Why the connection died, once it has.
    pub(super) fn why(&self) -> Option<String> {
        self.why.get().cloned()
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

    pub(super) fn submit(&self, req: Request) -> Result<()> {
        if !self.alive() {
            return Err(self.lost());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        // A small request's one chunk, planned without allocating (most requests).
        let (single, planned);
        let chunks: &[(usize, usize, usize)] = if req.len <= INLINE.min(self.chunk) {
            single = [(0, 0, req.len)];
            &single
        } else {
            planned = self.plan(req.len);
            &planned
        };
        // One frame on flow 0, one reply: a waiter reads it itself while it spins, so the reply
        // reaches it with no hand-off from the receiver thread (and sends it, if held).
        let one = matches!(chunks[..], [(0, _, _)]);
        if one {
            req.work.set_progress(self.progress.clone());
        }
        // Posted: answered only if refused, done once written (one frame, in flow 0's order).
        let posted = req.posted && one && req.direction != Direction::Read;
        if posted {
            self.unfenced.store(true, Ordering::Relaxed);
        }
        let (op, status, operand) = match req.direction {
            Direction::Write => (Op::Write, 0, None),
            Direction::Read => (Op::Read, 0, None),
            Direction::Atomic(a, v) => (Op::Atomic, wire_atomic(a) as u8, Some(v)),
        };
        let (buffer, key, base) = (req.remote.buffer_id, req.remote.access_key, req.remote.offset);
        // Requests that carry no payload (reads, atomics) and writes of one frame are written by
        // the caller, as far as the socket takes them now (no hand-off to the sender thread:
        // 96 KiB to 768 KiB writes measured 12-34% faster); striped writes go to the flows'
        // sender threads, so their stripes move in parallel.
        let inline = req.len <= INLINE || op != Op::Write || chunks.len() == 1;
        let pending = Arc::new(Pending { req, remaining: AtomicUsize::new(chunks.len()), error: Mutex::new(None) });
        // A posted request's frame holds it until written (`sent`), or until a failure clears
        // the queue (`fail`): no reply will look it up.
        if !posted {
            lock(&self.pending).insert(id, pending.clone());
            // A failure that raced with the insertion would never complete this request.
            if !self.alive() {
                lock(&self.pending).remove(&id);
                return Err(self.lost());
            }
        }
        for &(flow, at, n) in chunks {
            let header = Header {
                op,
                status,
                flags: if posted { POSTED } else { 0 },
                request: id,
                // An atomic's operand travels in the cookie (it has no local bytes to place).
                cookie: operand.unwrap_or(at as u64),
                buffer,
                key,
                remote_offset: base + at as u64,
                length: n as u64,
            };
            let len = if op == Op::Write { n } else { 0 };
            let frame = Frame { head: header.encode(), pending: Some(pending.clone()), posted, at, len, done: 0 };
            self.enqueue(flow, frame, inline, one);
        }
        Ok(())
    }

    /// Writes `frame` now if its flow has nothing queued and `now` (as much as the socket
    /// takes), and queues the rest for the flow's sender thread; while a hold is open, the
    /// frame of a one-frame request (whose waiter sends it, see `progress`) that would have
    /// been written now waits for the release instead. Never waits for the socket.
    fn enqueue(&self, flow: usize, frame: Frame, now: bool, holdable: bool) {
        let f = &self.flows[flow];
        let mut q = lock(&f.queue);
        // Read under the queue's lock, which `fail` takes after clearing `alive`: either this
        // frame is queued before `fail` clears the queue (and fails it there), or it is failed
        // here. (A request awaiting a reply is failed by `fail` through `pending` either way.)
        if !self.alive() {
            drop(q);
            fail_posted(frame, &self.lost_reason());
            return;
        }
        let idle = q.idle();
        q.frames.push_back(frame);
        // Read under the queue's lock, which `hold(false)` takes after its decrement: either
        // this frame is queued before that release looks, or this sees the decrement.
        if now && holdable && self.held.load(Ordering::Relaxed) > 0 {
            return;
        }
        if idle && now {
            match q.write_queued(&|f| self.sent(f)) {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => {
                    drop(q);
                    self.fail(format!("send to the peer: {e}"));
                    return;
                }
            }
        }
        q.kicked = true;
        f.more.notify_one();
    }

    /// A frame was written whole: a posted request is done.
    fn sent(&self, f: &Frame) {
        if f.posted
            && let Some(p) = &f.pending
        {
            p.req.complete(Ok(()));
        }
    }

    /// Waits, at most `within`, until the peer has served every posted request sent before
    /// this call (a FENCE, answered in order after them).
    pub(super) fn fence(&self, within: Duration) -> Result<()> {
        if !self.unfenced.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        let deadline = crate::sync::deadline(within);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let head = Header {
            op: Op::Fence,
            status: 0,
            flags: 0,
            request: id,
            cookie: 0,
            buffer: 0,
            key: [0; 16],
            remote_offset: 0,
            length: 0,
        };
        let frame = Frame { head: head.encode(), pending: None, posted: false, at: 0, len: 0, done: 0 };
        self.enqueue(0, frame, true, false);
        // Acquire: pairs with the Release store of the reader that saw the answer.
        while self.fenced.load(Ordering::Acquire) < id {
            if !self.alive() {
                return Err(self.lost());
            }
            if std::time::Instant::now() >= deadline {
                return Err(Error::timeout("tcp transport: the peer answering a fence", within));
            }
            self.progress(0);
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(())
    }

    /// Opens (`true`) or closes (`false`) a hold; the last close sends what was held, in as
    /// few system calls as the socket allows.
    pub(super) fn hold(&self, on: bool) {
        if on {
            self.held.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Relaxed: the queue's mutex orders this with `enqueue`'s load (see there).
        let was = self.held.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if was == Ok(1) {
            self.send_held();
        }
    }

    /// Writes flow 0's queued frames now, as far as the socket takes them; the sender thread
    /// gets the rest.
    fn send_held(&self) {
        let f = &self.flows[0];
        let mut q = lock(&f.queue);
        if q.idle() {
            return;
        }
        match q.write_queued(&|f| self.sent(f)) {
            Ok(true) => {}
            Ok(false) => {
                q.kicked = true;
                f.more.notify_one();
            }
            Err(e) => {
                drop(q);
                self.fail(format!("send to the peer: {e}"));
            }
        }
    }

    /// Writes a flow's queued frames as the socket takes them.
    fn send_loop(&self, flow: usize) {
        let f = &self.flows[flow];
        loop {
            let mut q = lock(&f.queue);
            while q.idle() || !q.kicked {
                if !self.alive() {
                    return;
                }
                q = f.more.wait_timeout(q, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
            }
            if !self.alive() {
                return;
            }
            let full = match q.write_queued(&|f| self.sent(f)) {
                Ok(done) => {
                    q.kicked = !done;
                    !done
                }
                Err(e) => {
                    drop(q);
                    self.fail(format!("send to the peer: {e}"));
                    return;
                }
            };
            drop(q);
            if full {
                // The socket is full: wait for room without holding the queue.
                wait_for(&f.poller, PollFlags::OUT, Duration::from_secs(1));
            }
        }
    }

    fn receive(&self, flow: usize) {
        #[cfg(test)]
        self.flows[flow].tid.store(rustix::thread::gettid().as_raw_nonzero().get(), Ordering::Relaxed);
        let why = match self.receive_loop(flow) {
            Ok(()) => "the peer closed the connection".to_string(),
            Err(e) => e.to_string(),
        };
        self.fail(why);
    }

    /// The flow's receiver: waits for replies without holding the reader (a caller may be
    /// reading its own), then reads whatever has arrived. Flow 0's stands aside while waiters
    /// read its replies themselves ([`super::STEP_ASIDE`]), napping 50 us at a time away from
    /// the socket, and goes back to the socket once they stop: asleep on the socket, every
    /// reply woke it, in the peer's system call and on a core a rank needs, to find the reply
    /// taken or to queue behind the waiter for the reader. (Standing aside yielding instead,
    /// as a served flow's thread does, it traded the core back and forth with a waiter that
    /// also yields between looks: 2 processes over tcp loopback, 6 paired runs, napping took
    /// 0.93-0.97x the time of an 8 B-4 KiB write or read, and of a cross-host signal
    /// ping-pong 0.91-0.93x.)
    fn receive_loop(&self, flow: usize) -> std::io::Result<()> {
        let f = &self.flows[flow];
        loop {
            if !self.alive() {
                return Ok(());
            }
            if flow == 0 && self.looks.recent() {
                let mut fds = [PollFd::new(&f.kick, PollFlags::IN)];
                let _ = poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 50_000 }));
                #[cfg(test)]
                f.naps.fetch_add(1, Ordering::Relaxed);
                // A kick meant for its sleep on the socket ends the nap; its count goes here, or
                // every later nap would end at once.
                let _ = rustix::io::read(&f.kick, &mut [0u8; 8]);
                continue;
            }
            // SeqCst, with the load in `Looks::recent`: pairs with a waiter's SeqCst store of its
            // look then swap of `asleep` in `progress`, so that either this thread sees the look
            // and stays up, or the waiter sees it asleep and wakes it.
            f.asleep.store(true, Ordering::SeqCst);
            if flow != 0 || !self.looks.recent() {
                let mut fds = [PollFd::new(&f.poller, PollFlags::IN), PollFd::new(&f.kick, PollFlags::IN)];
                let _ = poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 1, tv_nsec: 0 }));
            }
            f.asleep.store(false, Ordering::Relaxed);
            let _ = rustix::io::read(&f.kick, &mut [0u8; 8]);
            let mut reader = lock(&f.reader);
            loop {
                match self.read_one(&mut reader) {
                    Ok(Got::Frame) => {}
                    Ok(Got::Empty) => break,
                    Ok(Got::Closed) => return Ok(()),
                    Err(e) => {
                        // Said before the reader is free: a waiter taking it next would see
                        // only the end of the stream (the peer's last word is the reason).
                        let _ = self.why.set(e.to_string());
                        return Err(e);
                    }
                }
            }
        }
    }

    /// A waiter's turn at reading flow `flow`'s replies: whatever has arrived, if no other
    /// thread is reading (then that one delivers them). Never waits for a reply that has not
    /// begun to arrive; a broken connection fails the client.
    fn progress(&self, flow: usize) {
        // A waiter's own request may be held: it leaves now.
        if flow == 0 && self.held.load(Ordering::Relaxed) > 0 {
            self.send_held();
        }
        let f = &self.flows[flow];
        if flow == 0 {
            // SeqCst: pairs with the receiver's SeqCst store of `asleep` then load of the look
            // (see `receive_loop`). Woken once, it stands aside (napping away from the socket)
            // while waiters look.
            self.looks.looked();
            if f.asleep.load(Ordering::SeqCst) && f.asleep.swap(false, Ordering::SeqCst) {
                let _ = rustix::io::write(&f.kick, &1u64.to_ne_bytes());
            }
        }
        let Ok(mut reader) = f.reader.try_lock() else { return };
        loop {
            match self.read_one(&mut reader) {
                Ok(Got::Frame) => {}
                Ok(Got::Empty) => return,
                Ok(Got::Closed) => {
                    drop(reader);
                    return self.fail("the peer closed the connection".into());
                }
                Err(e) => {
                    // Said before the reader is free (see `receive_loop`).
                    let _ = self.why.set(e.to_string());
                    drop(reader);
                    return self.fail(e.to_string());
                }
            }
        }
    }

    /// Reads and handles one reply frame if one has begun to arrive (a frame begun is read
    /// whole, waiting for the rest); `Empty` if nothing has.
    fn read_one(&self, r: &mut Reader) -> std::io::Result<Got> {
        if r.buffered() < r.head_len() {
            match r.fill()? {
                None if r.buffered() == 0 => return Ok(Got::Closed),
                None => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Some(0) if r.buffered() == 0 => return Ok(Got::Empty),
                Some(_) => {}
            }
        }
        let Some(hdr) = r.header(&self.alive)? else { return Ok(Got::Closed) };
        self.handle(r, &hdr)?;
        Ok(Got::Frame)
    }

    /// Handles one reply whose header is `hdr` (reading its payload from `s`).
    fn handle(&self, s: &mut Reader, hdr: &[u8; HEADER_LEN]) -> std::io::Result<()> {
        {
            let h = Header::decode(hdr).map_err(std::io::Error::other)?;
            if h.op == Op::Fence {
                // Release: pairs with the Acquire load in `fence`.
                self.fenced.fetch_max(h.request, Ordering::Release);
                return Ok(());
            }
            if h.op == Op::Error && h.request == GOODBYE && h.length <= MAX_ERROR_LEN {
                // The peer's last word before it closes the connection.
                let mut msg = vec![0u8; h.length as usize];
                s.payload(&mut msg, &self.alive)?;
                return Err(std::io::Error::other(format!(
                    "the peer ended the connection: {}",
                    String::from_utf8_lossy(&msg)
                )));
            }
            let found = lock(&self.pending).get(&h.request).cloned();
            let p = match found {
                Some(p) => p,
                None if h.op == Op::Error && h.flags & POSTED != 0 && h.length <= MAX_ERROR_LEN => {
                    // Its Work completed when sent: the connection carries the refusal.
                    let mut msg = vec![0u8; h.length as usize];
                    s.payload(&mut msg, &self.alive)?;
                    return Err(std::io::Error::other(format!(
                        "the peer refused a posted request: {}",
                        String::from_utf8_lossy(&msg)
                    )));
                }
                None => return Err(std::io::Error::other(format!("reply to unknown request {}", h.request))),
            };
            let error = match h.op {
                Op::Ack if h.status == ATOMIC_BUSY && matches!(p.req.direction, Direction::Atomic(..)) => {
                    Some(Failed::new(TransferKind::Busy, "the remote signal slot still holds an unconsumed signal"))
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
                    s.payload(dst, &self.alive)?;
                    None
                }
                Op::Error => {
                    if h.length > MAX_ERROR_LEN {
                        return Err(std::io::Error::other("oversized error message"));
                    }
                    let mut msg = vec![0u8; h.length as usize];
                    s.payload(&mut msg, &self.alive)?;
                    Some(Failed::new(
                        TransferKind::Refused,
                        format!("the peer refused it: {}", String::from_utf8_lossy(&msg)),
                    ))
                }
                other => return Err(std::io::Error::other(format!("unexpected {other:?} frame from the target"))),
            };
            if p.chunk_done(error) {
                lock(&self.pending).remove(&h.request);
                let e = lock(&p.error).take();
                p.req.complete(e.map_or(Ok(()), Err));
            }
        }
        Ok(())
    }

    #[cold]
    fn lost(&self) -> Error {
        Error::transfer(
            TransferKind::PeerLost,
            format!(
                "tcp transport is not connected: {}",
                self.why.get().map_or("the connection was lost", String::as_str)
            ),
        )
    }

    /// Marks the connection dead and fails everything pending.
    pub(super) fn fail(&self, why: String) {
        let _ = self.why.set(why);
        // Release: pairs with the Acquire loads in `alive` and `read_full`.
        self.alive.store(false, Ordering::Release);
        let why = self.lost_reason();
        for f in &self.flows {
            let mut q = lock(&f.queue);
            let unsent = q.take_unsent();
            let _ = q.sock.shutdown(std::net::Shutdown::Both);
            f.more.notify_all();
            drop(q);
            for frame in unsent {
                fail_posted(frame, &why);
            }
        }
        let pending: Vec<Arc<Pending>> = lock(&self.pending).drain().map(|(_, p)| p).collect();
        for p in pending {
            p.req.complete(Err(Failed::new(TransferKind::PeerLost, why.clone())));
        }
    }

    /// What a request failed by a lost connection says.
    fn lost_reason(&self) -> String {
        format!("connection to the peer lost: {}", self.why.get().map_or("the connection was lost", String::as_str))
    }
}

#[cfg(test)]
impl Client {
    /// How often flow `flow`'s receiver napped aside.
    pub(super) fn naps(&self, flow: usize) -> u64 {
        self.flows[flow].naps.load(Ordering::Relaxed)
    }

    /// Flow `flow`'s receiver thread, once it started.
    pub(super) fn receiver_tid(&self, flow: usize) -> i32 {
        self.flows[flow].tid.load(Ordering::Relaxed)
    }
}

/// Fails the request of a posted frame that will never be written (a request awaiting a reply
/// is failed through `Client::pending`).
fn fail_posted(frame: Frame, why: &str) {
    if frame.posted
        && let Some(p) = frame.pending
    {
        p.req.complete(Err(Failed::new(TransferKind::PeerLost, why.to_string())));
    }
}

/// The wire's code for a remote atomic.
fn wire_atomic(a: crate::transport::Atomic) -> crate::wire::tcp::Atomic {
    use crate::transport::Atomic as A;
    use crate::wire::tcp::Atomic as W;
    match a {
        A::SlotPut => W::SlotPut,
        A::Set32 => W::Set32,
        A::Set64 => W::Set64,
    }
}
