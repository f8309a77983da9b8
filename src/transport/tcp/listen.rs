//! The target's side of the `tcp` backend: accepting flows (every handshake at once, on the
//! accept thread, bounded in number and time), then serving each on a thread of its own.
//!
//! A connection gets a thread only after its handshake succeeded: until then it is one entry
//! in the accept thread's poll set, at most [`MAX_PENDING`] of them (a new one closes the
//! oldest), each given [`HANDSHAKE_TIME`] at most. At most [`MAX_SERVED`] flows are served at
//! once. A client of another user on this host is refused from its socket's credentials.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};

use super::{CLIENT_PROOF, Inner, LINK_KEYS, MAX_CHUNK, MAX_FLOWS, ReadAhead, SERVER_PROOF, lock, tune};
use crate::wire::seal::{Keys, Opener, RECORD_MAX, Sealer, Side, TAG_LEN};
use crate::wire::tcp::{
    ATOMIC_BUSY, Atomic, Auth, Challenge, HEADER_LEN, HELLO_LEN, Header, Hello, MAX_ERROR_LEN, Op, POSTED, PROOF_LEN,
    Refused, sealed, transcript,
};

/// The most connections in their handshake at once.
pub(super) const MAX_PENDING: usize = 64;
/// The longest a handshake may take.
pub(super) const HANDSHAKE_TIME: Duration = Duration::from_secs(10);
/// The most flows served at once (each has a thread).
pub(super) const MAX_SERVED: usize = 4 * MAX_FLOWS as usize;

/// A connection in its handshake.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    /// Bytes of the message being received.
    got: Vec<u8>,
    /// Once the hello is in: it, and this side's answer.
    hello: Option<(Hello, Challenge)>,
}

/// What to do with a pending connection after reading from it.
enum Next {
    Wait,
    Drop(String),
    /// Serve it, with the keys of its sealed records unless its frames travel exposed.
    Serve(Option<Box<Keys>>),
}

/// Accepts flows until the transport shuts down.
pub(super) fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let mut pending: VecDeque<Pending> = VecDeque::new();
    loop {
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        pending.retain(|p| {
            let alive = p.deadline > now;
            if !alive {
                tracing::debug!(peer = %p.peer, "tcp transport: no handshake within {HANDSHAKE_TIME:?}");
            }
            alive
        });
        let wait =
            pending.iter().map(|p| p.deadline.saturating_duration_since(now)).min().unwrap_or(Duration::from_secs(1));
        let ready: Vec<bool> = {
            let mut fds = Vec::with_capacity(pending.len() + 1);
            fds.push(PollFd::new(&listener, PollFlags::IN));
            fds.extend(pending.iter().map(|p| PollFd::new(&p.stream, PollFlags::IN)));
            let t = rustix::time::Timespec {
                tv_sec: wait.as_secs() as i64,
                tv_nsec: i64::from(wait.subsec_nanos()).max(1_000_000),
            };
            if poll(&mut fds, Some(&t)).is_err() {
                // EINTR: look again.
                continue;
            }
            fds.iter().map(|f| !f.revents().is_empty()).collect()
        };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Handshake steps first (the indices of `ready` name today's pending list).
        let mut keep = VecDeque::with_capacity(pending.len());
        for (p, r) in pending.drain(..).zip(&ready[1..]) {
            if !r {
                keep.push_back(p);
                continue;
            }
            let mut p = p;
            match step(&inner, &mut p) {
                Next::Wait => keep.push_back(p),
                Next::Drop(why) => tracing::debug!(peer = %p.peer, "tcp transport: refused a connection: {why}"),
                Next::Serve(keys) => {
                    let flow = p.hello.map_or(0, |(h, _)| h.flow);
                    start_serving(&inner, p.stream, p.peer, flow, keys)
                }
            }
        }
        pending = keep;
        if ready[0] {
            loop {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if stream.set_nonblocking(true).is_err() {
                            continue;
                        }
                        if pending.len() >= MAX_PENDING {
                            // The oldest has had the longest; dropping it closes it.
                            pending.pop_front();
                        }
                        let deadline = Instant::now() + HANDSHAKE_TIME.min(inner.opts.timeout);
                        pending.push_back(Pending { stream, peer, deadline, got: Vec::new(), hello: None });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        if inner.closed.load(Ordering::Acquire) {
                            return;
                        }
                        // EMFILE and the like: back off rather than spin.
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                }
            }
        }
    }
}

/// Reads what a pending connection sent and takes the handshake's next step.
fn step(inner: &Inner, p: &mut Pending) -> Next {
    let need = if p.hello.is_none() { HELLO_LEN } else { PROOF_LEN };
    let mut buf = [0u8; HELLO_LEN];
    let want = need - p.got.len();
    match (&p.stream).read(&mut buf[..want]) {
        Ok(0) => return Next::Drop("closed during the handshake".into()),
        Ok(n) => p.got.extend_from_slice(&buf[..n]),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {
            return Next::Wait;
        }
        Err(e) => return Next::Drop(e.to_string()),
    }
    if p.got.len() < need {
        return Next::Wait;
    }
    let got = std::mem::take(&mut p.got);
    match p.hello {
        None => {
            let mut h = [0u8; HELLO_LEN];
            h.copy_from_slice(&got);
            let hello = match Hello::decode(&h) {
                Ok(h) => h,
                Err(e) => return Next::Drop(e.to_string()),
            };
            let (challenge, refused) = challenge(inner, p, &hello);
            if !send(&p.stream, &challenge.encode()) {
                return Next::Drop("could not answer the hello".into());
            }
            if let Some(r) = refused {
                return Next::Drop(format!("refused: {r}"));
            }
            p.hello = Some((hello, challenge));
            Next::Wait
        }
        Some((hello, challenge)) => {
            let t = transcript(&hello, &challenge);
            let (good, keys) = match &inner.opts.secret {
                Some(secret) => (
                    secret.check(CLIENT_PROOF, &[&t], &got),
                    sealed(&hello, &challenge).then(|| Box::new(secret.link_keys(LINK_KEYS, &t, Side::Server))),
                ),
                None => (true, None),
            };
            let verdict = if good { 0 } else { Refused::BadProof as u8 };
            if !send(&p.stream, &[verdict]) || !good {
                return Next::Drop("a wrong proof of the job's secret".into());
            }
            Next::Serve(keys)
        }
    }
}

/// This side's answer to a hello, and whether it refuses the flow.
fn challenge(inner: &Inner, p: &Pending, hello: &Hello) -> (Challenge, Option<Refused>) {
    let auth = inner.opts.auth();
    let mut nonce = [0u8; 32];
    let refused = if getrandom::fill(&mut nonce).is_err() {
        Some(Refused::Busy)
    } else if p.stream.local_addr().is_err()
        || p.stream.local_addr().is_ok_and(|l| crate::sys::peercred::same_user_or_remote(l, p.peer).is_err())
    {
        // Another user's process on this host, or one of this host whose owner cannot be
        // established (it closed at once, its handshake and frames queued): refused before any
        // of its bytes is acted on.
        Some(Refused::ForeignUser)
    } else if hello.client_token == inner.token {
        Some(Refused::Reflected)
    } else if hello.server_token != inner.token
        || hello.flows == 0
        || hello.flows > MAX_FLOWS
        || hello.flow >= hello.flows
    {
        Some(Refused::Token)
    } else if auth == Auth::JobSecret && hello.auth != Auth::JobSecret {
        Some(Refused::SecretRequired)
    } else if inner.serving.load(Ordering::Relaxed) >= MAX_SERVED {
        Some(Refused::Busy)
    } else {
        None
    };
    // A client with a secret talking to an endpoint without one refuses it itself (the
    // endpoint answers Token and no proof).
    let mut c = Challenge { refused, auth, frames: inner.opts.frames, nonce, proof: [0u8; 32] };
    if let (Some(secret), Auth::JobSecret, None) = (&inner.opts.secret, hello.auth, refused) {
        c.proof = secret.sign(SERVER_PROOF, &[&transcript(hello, &c)]);
    }
    (c, refused)
}

/// Writes a handshake message whole: a fresh socket's buffer takes it at once, or the peer is
/// not worth waiting for.
fn send(s: &TcpStream, bytes: &[u8]) -> bool {
    let mut s = s;
    s.write(bytes).is_ok_and(|n| n == bytes.len())
}

fn start_serving(inner: &Arc<Inner>, stream: TcpStream, peer: SocketAddr, flow: u32, keys: Option<Box<Keys>>) {
    tune(&stream, inner.opts.timeout);
    let Ok(poller) = stream.try_clone() else { return };
    let Ok(kick) =
        rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)
    else {
        return;
    };
    let served = Arc::new(Served {
        flow,
        poller,
        kick,
        kicked: AtomicBool::new(false),
        asleep: AtomicBool::new(false),
        conn: Mutex::new(Conn::new(stream, peer, keys)),
        #[cfg(test)]
        tid: std::sync::atomic::AtomicI32::new(0),
    });
    inner.serving.fetch_add(1, Ordering::Relaxed);
    let inner2 = inner.clone();
    let spawned = std::thread::Builder::new().name("symmem-tcp-serve".into()).spawn(move || {
        let inner = inner2;
        #[cfg(test)]
        served.tid.store(rustix::thread::gettid().as_raw_nonzero().get(), Ordering::Relaxed);
        let id = inner.next_served.fetch_add(1, Ordering::Relaxed);
        inner.served.write().unwrap_or_else(|p| p.into_inner()).insert(id, served.clone());
        if inner.closed.load(Ordering::Acquire) {
            let _ = served.poller.shutdown(std::net::Shutdown::Both);
        }
        if let Err(e) = serve(&inner, &served) {
            tracing::debug!("tcp transport: closing a served connection: {e}");
        }
        // Close for real: the clones kept for waiters and `shutdown` would otherwise hold it
        // open.
        let _ = served.poller.shutdown(std::net::Shutdown::Both);
        inner.served.write().unwrap_or_else(|p| p.into_inner()).remove(&id);
        inner.serving.fetch_sub(1, Ordering::Relaxed);
    });
    if spawned.is_err() {
        inner.serving.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A flow being served. Whoever holds `conn` serves it: the flow's thread, which waits for
/// requests without holding it, or a caller waiting for a signal from the peer
/// ([`serve_arrived`]), which then needs no other thread to apply it. Nobody waits for a
/// write's payload while holding it: whoever looks receives what has arrived, and the next
/// look goes on (`Conn::land`), so a waiting caller receives a peer's message as it arrives. A
/// caller never waits for the peer; what it leaves (a header still arriving, a large read,
/// answers the socket had no room for) it hands to the thread through `kick`.
pub(super) struct Served {
    /// The flow's index among its client's flows (flow 0 carries the small requests).
    flow: u32,
    /// The same socket, to wait for requests without holding `conn`, and to shut it down.
    pub(super) poller: TcpStream,
    /// An eventfd that wakes the flow's thread for what a caller left.
    kick: std::os::fd::OwnedFd,
    /// Set with every kick: the thread, standing aside while callers look, checks it without a
    /// system call.
    kicked: AtomicBool,
    /// The flow's thread sleeps (or is about to) waiting for its socket or a kick: a caller
    /// that starts serving the flow wakes it once, to stand aside awake.
    asleep: AtomicBool,
    conn: Mutex<Conn>,
    /// The flow's thread (tests read its scheduling counts).
    #[cfg(test)]
    pub(super) tid: std::sync::atomic::AtomicI32,
}

impl Served {
    /// Hands the flow to its thread, awake or asleep.
    fn kick(&self) {
        // Release: pairs with the Acquire swap in `serve`.
        self.kicked.store(true, Ordering::Release);
        self.wake();
    }

    /// Ends the thread's sleep, if it sleeps.
    fn wake(&self) {
        let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
    }
}

/// Bytes of requests read ahead: the requests that arrived together (a write and the signal
/// that follows it) are read with one system call and answered with one.
const READ_AHEAD: usize = 8 * 1024;
/// Replies with more payload than this are written at once rather than gathered.
const GATHER_MAX: usize = 16 * 1024;
/// The most replies a caller serving a flow leaves gathered (those the socket did not take).
const CALLER_OUT_MAX: usize = 64 * 1024;
/// The most requests a caller serves per look at a flow: a peer that keeps sending cannot
/// keep a caller from its own work (the flow's thread takes the rest).
const CALLER_QUOTA: usize = 64;
/// The most payload bytes a caller receives per look at a flow (the flow's thread, or the
/// caller's next look, receives the rest).
const CALLER_BYTES: usize = 256 * 1024;

/// Who is serving: the flow's thread, which may wait for the peer, or a caller that must not.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Who {
    Thread,
    Caller,
}

/// A served flow's socket (non-blocking), read ahead and answered in batches. Gathered
/// replies are written whenever the requests that have arrived are all handled, and before
/// every wait for more, so the peer never waits for an answer this side holds.
struct Conn {
    s: TcpStream,
    /// Who is at the other end (for what is logged of it).
    peer: SocketAddr,
    ahead: ReadAhead,
    out: Vec<u8>,
    /// Who is serving it now.
    who: Who,
    /// Requests taken so far (by anyone).
    taken: u64,
    /// Requests the one serving it now may still take (a caller takes a few, then returns).
    quota: usize,
    /// Payload bytes the one serving it now may still receive.
    budget: usize,
    /// A request whose header was read, left by a caller for the flow's thread (a large read).
    peeked: Option<Header>,
    /// The write whose payload is arriving, when a caller left it part-received (it received
    /// what had arrived and never waits for the rest): whoever serves the flow next goes on.
    landing: Option<Landing>,
    /// The flow's sealed records, unless its frames travel exposed.
    seal: Option<ConnSeal>,
    /// Why the flow ended, when the peer broke the protocol: nothing more is served, and its
    /// thread lingers before it closes ([`Conn::linger`]).
    ended: Option<String>,
}

/// A served flow's record protection: what opens the requests, what seals the replies, and
/// the record being received (a payload is opened a record at a time, and only then copied
/// to its destination).
struct ConnSeal {
    opener: Opener,
    sealer: Sealer,
    /// The bytes of the record being received ([`RECORD_MAX`] + [`TAG_LEN`] at most).
    rec: Box<[u8]>,
    /// How many of them have arrived.
    staged: usize,
    /// Records of a large reply, sealed before they are written.
    stage: Vec<u8>,
}

/// A write's payload being received: into registered memory, or, refused, read and dropped.
struct Landing {
    h: Header,
    /// Where it goes (the registration, kept alive while its bytes arrive), or `Err(why)`
    /// for a refused write, answered with the reason once its payload is read.
    dst: std::result::Result<Arc<crate::transport::Registration>, String>,
    /// Payload bytes received (sealed: opened and copied) so far.
    done: usize,
}

/// What looking for the next request found.
enum Arrived {
    /// A request's header (its payload follows, read whole by the thread, or already buffered
    /// for a caller).
    Request(Header),
    /// Nothing more to serve now (at a request boundary, or for a caller, what is left is for
    /// the thread).
    Empty,
    /// The peer closed the flow (at a request boundary).
    End,
}

/// Waits until `s` is readable (`IN`) or writable (`OUT`), at most a second; an error once the
/// transport is closed.
fn wait(inner: &Inner, s: &TcpStream, flags: PollFlags) -> std::io::Result<()> {
    if inner.closed.load(Ordering::Acquire) {
        return Err(std::io::Error::other("the transport was closed"));
    }
    let mut fds = [PollFd::new(s, flags)];
    let t = rustix::time::Timespec { tv_sec: 1, tv_nsec: 0 };
    let _ = poll(&mut fds, Some(&t));
    Ok(())
}

/// Writes what `s` takes of `bytes` now, and with `who` the thread the rest, waiting for room;
/// how much was written.
fn write_some(inner: &Inner, mut s: &TcpStream, bytes: &[u8], who: Who) -> std::io::Result<usize> {
    let mut done = 0;
    while done < bytes.len() {
        match s.write(&bytes[done..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && who == Who::Caller => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait(inner, s, PollFlags::OUT)?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Records of a large reply sealed per system call.
const STAGE_RECORDS: usize = 1;

/// The request id of an ERROR that ends the connection (requests are numbered from 1): the
/// server's last word, before it closes, on a peer that broke the protocol.
pub(super) const GOODBYE: u64 = 0;

impl Conn {
    fn new(s: TcpStream, peer: SocketAddr, keys: Option<Box<Keys>>) -> Conn {
        Conn {
            s,
            peer,
            ahead: ReadAhead::new(READ_AHEAD),
            out: Vec::with_capacity(1024),
            who: Who::Thread,
            taken: 0,
            quota: usize::MAX,
            budget: usize::MAX,
            peeked: None,
            landing: None,
            ended: None,
            seal: keys.map(|k| ConnSeal {
                opener: k.opener,
                sealer: k.sealer,
                rec: vec![0u8; RECORD_MAX + TAG_LEN].into_boxed_slice(),
                staged: 0,
                stage: Vec::new(),
            }),
        }
    }

    /// The bytes of a request's header on the wire.
    fn head_len(&self) -> usize {
        HEADER_LEN + if self.seal.is_some() { TAG_LEN } else { 0 }
    }

    /// Writes the gathered replies (a caller: what the socket takes now; the rest stays).
    fn flush(&mut self, inner: &Inner) -> std::io::Result<()> {
        let n = write_some(inner, &self.s, &self.out, self.who)?;
        self.out.drain(..n);
        Ok(())
    }

    /// Ends the flow on a peer that broke the protocol (a record that failed to open, a
    /// malformed frame): tells it why in a last ERROR ([`GOODBYE`], sealed like every reply,
    /// sent if the socket takes it now), logs it, and returns the error that closes the flow.
    #[cold]
    fn violation(&mut self, inner: &Inner, why: String) -> std::io::Error {
        tracing::warn!(peer = %self.peer, "tcp transport: closing a connection: {why}");
        let m = why.as_bytes();
        let bye = Header {
            op: Op::Error,
            status: 0,
            flags: POSTED,
            request: GOODBYE,
            cookie: 0,
            buffer: 0,
            key: [0; 16],
            remote_offset: 0,
            length: m.len().min(MAX_ERROR_LEN as usize) as u64,
        };
        let (who, msg) = (self.who, &m[..bye.length as usize]);
        // Best effort, never waiting: the flow ends either way. Then the end of what this side
        // sends, so the last word is read before the connection closes.
        self.who = Who::Caller;
        let _ = self.send(inner, &bye, msg).and_then(|()| self.flush(inner));
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        self.who = who;
        self.ended = Some(why.clone());
        std::io::Error::other(why)
    }

    /// Before a flow ended for a broken protocol closes: reads and drops what the peer still
    /// sends, until it closes too, for at most a second and 64 MiB. Closed with unread bytes
    /// queued, the socket would answer with a reset, and a reset can discard the last word
    /// before the peer reads it.
    fn linger(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut left = MAX_CHUNK;
        let mut sink = [0u8; 16 * 1024];
        while left > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match (&self.s).read(&mut sink) {
                Ok(0) => break,
                Ok(n) => left = left.saturating_sub(n as u64),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let wait = deadline - now;
                    let mut fds = [PollFd::new(&self.s, PollFlags::IN)];
                    let t = rustix::time::Timespec { tv_sec: 0, tv_nsec: i64::from(wait.subsec_nanos()) };
                    let _ = poll(&mut fds, Some(&t));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }

    /// Takes the next request's header out of the read-ahead if it is there whole (sealed:
    /// opens its record).
    fn take_header(&mut self, inner: &Inner) -> std::io::Result<Option<Header>> {
        let n = self.head_len();
        if self.ahead.buffered() < n {
            return Ok(None);
        }
        let mut wire = [0u8; HEADER_LEN + TAG_LEN];
        self.ahead.take(&mut wire[..n]);
        let plain = match &mut self.seal {
            None => Ok(&wire[..HEADER_LEN]),
            Some(cs) => cs.opener.open_in_place(&mut wire[..n]).map(|p| &*p),
        };
        let plain = match plain {
            Ok(p) => p,
            Err(e) => return Err(self.violation(inner, e.to_string())),
        };
        let mut hdr = [0u8; HEADER_LEN];
        hdr.copy_from_slice(plain);
        match Header::decode(&hdr) {
            Ok(h) if h.length > MAX_CHUNK => {
                Err(self.violation(inner, format!("a frame of {} bytes exceeds {MAX_CHUNK}", h.length)))
            }
            Ok(h) => Ok(Some(h)),
            Err(e) => Err(self.violation(inner, e.to_string())),
        }
    }

    /// The next request's header if one has begun to arrive: the thread reads it whole,
    /// waiting for the rest; a caller takes it only if the header arrived whole, and not a
    /// large read (whose answer may not fit the socket, left read for the thread), nor more
    /// than its quota, nor while its gathered replies are large (a socket that took no more).
    /// A write's payload is received after (`land`). Otherwise, with the gathered replies
    /// written, `Empty` or `End`.
    fn next(&mut self, inner: &Inner) -> std::io::Result<Arrived> {
        let who = self.who;
        if who == Who::Caller && (self.quota == 0 || self.out.len() >= CALLER_OUT_MAX) {
            self.flush(inner)?;
            return Ok(Arrived::Empty);
        }
        loop {
            let h = match self.peeked.take() {
                Some(h) => Some(h),
                None => self.take_header(inner)?,
            };
            if let Some(h) = h {
                // A caller answers a small read into the gathered replies, as long as they
                // stay small; a socket that takes no more leaves them to the thread (woken for
                // them), which then waits for room: a peer that stops reading its answers
                // makes this side hold at most CALLER_OUT_MAX more bytes.
                if who == Who::Caller
                    && h.op == Op::Read
                    && (h.length > GATHER_MAX as u64 || self.out.len() + h.length as usize > CALLER_OUT_MAX)
                {
                    self.peeked = Some(h);
                    self.flush(inner)?;
                    return Ok(Arrived::Empty);
                }
                self.taken += 1;
                self.quota = self.quota.saturating_sub(1);
                return Ok(Arrived::Request(h));
            }
            match self.ahead.fill(&self.s)? {
                None if self.ahead.buffered() == 0 => return Ok(Arrived::End),
                None => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Some(0) if self.ahead.buffered() == 0 || who == Who::Caller => {
                    self.flush(inner)?;
                    return Ok(Arrived::Empty);
                }
                Some(0) => {
                    self.flush(inner)?;
                    wait(inner, &self.s, PollFlags::IN)?;
                }
                Some(_) => {}
            }
        }
    }

    /// Receives the payload of the write being landed: what was read ahead, then straight
    /// from the socket into its destination (or dropped, for a refused write): what has
    /// arrived, a caller at most its byte budget. Sealed, each record is received into the
    /// flow's record buffer, opened, and only then copied to the destination. The rest is left
    /// to whoever serves the flow next, so no one holds the flow while a payload travels and a
    /// waiting caller can receive it as it arrives. Once whole, the write is answered (unless
    /// posted and accepted) and `true`; `false` if it is still arriving.
    fn land(&mut self, inner: &Inner) -> std::io::Result<bool> {
        if self.seal.is_some() {
            return self.land_sealed(inner);
        }
        let Conn { s, ahead, budget, landing, .. } = self;
        let Some(l) = landing.as_mut() else { return Ok(true) };
        // MAX_CHUNK (checked in `take_header`) bounds it; the thread's budget never runs out.
        let len = l.h.length as usize;
        while l.done < len && *budget > 0 {
            let want = (len - l.done).min(*budget);
            let got = match &l.dst {
                Ok(reg) => {
                    // SAFETY: check_access put [offset, offset+length) inside the
                    // registration, whose storage `reg` keeps alive, and done + want <= length.
                    // The owner promised not to touch memory exposed to peers while transfers
                    // run (the transport contract), and the one serving this flow (holding
                    // `conn`) is the only writer of this payload.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(reg.ptr().add(l.h.remote_offset as usize + l.done), want)
                    };
                    match ahead.take(dst) {
                        0 => match (&*s).read(dst) {
                            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                            Ok(k) => k,
                            // The rest is for the next look (the thread's, once the socket is
                            // readable, or a caller's): nobody holds the flow while it travels.
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => return Err(e),
                        },
                        k => k,
                    }
                }
                // Refused: its bytes are dropped through the read-ahead.
                Err(_) => match ahead.skip(want as u64) {
                    0 => match ahead.fill(s)? {
                        None => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                        Some(0) => break,
                        Some(_) => continue,
                    },
                    k => k as usize,
                },
            };
            l.done += got;
            *budget = budget.saturating_sub(got);
        }
        self.landed(inner)
    }

    /// [`Conn::land`] for a sealed flow.
    fn land_sealed(&mut self, inner: &Inner) -> std::io::Result<bool> {
        let Conn { s, ahead, budget, landing, seal, .. } = self;
        let (Some(l), Some(cs)) = (landing.as_mut(), seal.as_mut()) else { return Ok(true) };
        let len = l.h.length as usize;
        while l.done < len && *budget > 0 {
            let plain = (len - l.done).min(RECORD_MAX);
            let wire = plain + TAG_LEN;
            let rec = &mut cs.rec[cs.staged..wire];
            let got = match ahead.take(rec) {
                0 => match (&*s).read(rec) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(k) => k,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                },
                k => k,
            };
            cs.staged += got;
            *budget = budget.saturating_sub(got);
            if cs.staged < wire {
                continue;
            }
            cs.staged = 0;
            let bytes = match cs.opener.open_in_place(&mut cs.rec[..wire]) {
                Ok(b) => b,
                Err(e) => {
                    let why = e.to_string();
                    return Err(self.violation(inner, why));
                }
            };
            if let Ok(reg) = &l.dst {
                // SAFETY: check_access put [offset, offset+length) inside the registration,
                // whose storage `reg` keeps alive, and done + plain <= length. The owner
                // promised not to touch memory exposed to peers while transfers run, and the
                // one serving this flow (holding `conn`) is the only writer of this payload.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(reg.ptr().add(l.h.remote_offset as usize + l.done), plain)
                };
                dst.copy_from_slice(bytes);
            }
            l.done += plain;
        }
        self.landed(inner)
    }

    /// Answers the write being landed once its payload is whole: `true`; `false` (with the
    /// gathered replies written) while it still arrives.
    fn landed(&mut self, inner: &Inner) -> std::io::Result<bool> {
        let Some(l) = self.landing.as_ref() else { return Ok(true) };
        if l.done < l.h.length as usize {
            self.flush(inner)?;
            return Ok(false);
        }
        let Some(l) = self.landing.take() else { return Ok(true) };
        match l.dst {
            Ok(_) if l.h.flags & POSTED != 0 => {}
            Ok(_) => self.reply(inner, &l.h, Op::Ack, &[])?,
            Err(msg) => self.refuse(inner, &l.h, &msg)?,
        }
        Ok(true)
    }

    /// Answers a request: gathered while more requests are buffered, written before the next
    /// wait (and at once when it carries much: only the thread serves reads that large).
    fn send(&mut self, inner: &Inner, h: &Header, payload: &[u8]) -> std::io::Result<()> {
        let Some(cs) = &mut self.seal else {
            self.out.extend_from_slice(&h.encode());
            if payload.len() > GATHER_MAX {
                // Only the thread serves reads this large (see `next`).
                self.flush(inner)?;
                write_some(inner, &self.s, payload, Who::Thread)?;
                return Ok(());
            }
            self.out.extend_from_slice(payload);
            if self.out.len() >= READ_AHEAD {
                self.flush(inner)?;
            }
            return Ok(());
        };
        let sealing = |e| std::io::Error::other(format!("seal a reply: {e}"));
        cs.sealer.seal_into(&mut self.out, &h.encode()).map_err(sealing)?;
        if payload.len() <= GATHER_MAX {
            for part in payload.chunks(RECORD_MAX) {
                cs.sealer.seal_into(&mut self.out, part).map_err(sealing)?;
            }
            if self.out.len() >= READ_AHEAD {
                self.flush(inner)?;
            }
            return Ok(());
        }
        // Only the thread serves reads this large: their records are sealed a few at a time
        // and written, waiting for room.
        self.flush(inner)?;
        let Some(cs) = &mut self.seal else { return Ok(()) };
        for parts in payload.chunks(RECORD_MAX * STAGE_RECORDS) {
            cs.stage.clear();
            for part in parts.chunks(RECORD_MAX) {
                cs.sealer.seal_into(&mut cs.stage, part).map_err(sealing)?;
            }
            write_some(inner, &self.s, &cs.stage, Who::Thread)?;
        }
        cs.stage = Vec::new();
        Ok(())
    }

    /// Answers a request with an ERROR carrying why (cut to the wire's limit).
    fn refuse(&mut self, inner: &Inner, req: &Header, why: &str) -> std::io::Result<()> {
        let m = why.as_bytes();
        self.reply(inner, req, Op::Error, &m[..m.len().min(MAX_ERROR_LEN as usize)])
    }

    fn reply(&mut self, inner: &Inner, req: &Header, op: Op, payload: &[u8]) -> std::io::Result<()> {
        let h = Header { op, status: 0, length: if op == Op::Ack { req.length } else { payload.len() as u64 }, ..*req };
        self.send(inner, &h, payload)
    }
}

/// Serves one flow that passed its handshake: requests in, replies out, until the peer closes
/// or breaks the protocol. Waits for requests (or a caller's kick) without holding the flow,
/// so a waiter may serve them first. For the spin budget (`SYMMEM_SPIN_US`) after it last
/// found a request it keeps looking, yielding between looks, before it sleeps: the next
/// request of a stream then needs no wake-up. Flow 0's thread stands aside, awake, while
/// callers look at the flow ([`super::STEP_ASIDE`]), and takes over once they stop.
fn serve(inner: &Inner, served: &Served) -> std::io::Result<()> {
    let linger = crate::config::spin();
    let mut found: Option<Instant> = None;
    loop {
        if inner.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        // Acquire: pairs with the Release store in `Served::kick`: what the caller left is the
        // thread's now (the eventfd's count goes at its next sleep).
        let kicked = served.kicked.swap(false, Ordering::Acquire);
        if !kicked {
            if served.flow == 0 && inner.looks.recent() {
                // A waiting caller serves this flow itself ([`serve_arrived`]): out of its way,
                // awake (the next message then wakes nobody), lingering afresh once it stops.
                found = Some(Instant::now());
                std::thread::yield_now();
                continue;
            }
            if found.is_some_and(|t| t.elapsed() < linger) {
                std::thread::yield_now();
            } else {
                found = None;
                // SeqCst, with the load in `Looks::recent`: pairs with a caller's SeqCst store of
                // its look then swap of `asleep` in `serve_arrived`, so that either this thread
                // sees the look and stays up, or the caller sees it asleep and wakes it.
                served.asleep.store(true, Ordering::SeqCst);
                if !inner.looks.recent() {
                    let mut fds =
                        [PollFd::new(&served.poller, PollFlags::IN), PollFd::new(&served.kick, PollFlags::IN)];
                    let t = rustix::time::Timespec { tv_sec: 1, tv_nsec: 0 };
                    let _ = poll(&mut fds, Some(&t));
                }
                served.asleep.store(false, Ordering::Relaxed);
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&served.kick, &mut b);
            }
        }
        let mut c = lock(&served.conn);
        let before = c.taken;
        let outcome = serve_some(inner, &mut c, Who::Thread);
        if c.taken != before {
            found = Some(Instant::now());
            #[cfg(test)]
            inner.thread_took.fetch_add(c.taken - before, Ordering::Relaxed);
        }
        match outcome {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                // What was answered before the failure still goes out.
                let _ = c.flush(inner);
                if c.ended.is_some() {
                    c.linger();
                }
                return Err(e);
            }
        }
    }
}

/// Serves, on the calling thread, what has arrived on the flows that carry the requests
/// ordered with signals (flow 0 of each client), unless their threads are at it: requests
/// whose header arrived, and of a write's payload what has arrived (at most [`CALLER_BYTES`]
/// per look). Never waits for the peer (bytes still travelling, room for an answer): what it
/// leaves, the next look or the flow's thread (woken by the socket or a kick) takes.
pub(super) fn serve_arrived(inner: &Inner) {
    inner.looks.looked();
    let served = inner.served.read().unwrap_or_else(|p| p.into_inner());
    for s in served.values().filter(|s| s.flow == 0) {
        // SeqCst: see the thread's store of `asleep` in `serve`. Woken once, it stands aside
        // awake while callers look: a message then wakes nobody (asleep, every message that
        // arrived woke it, to find it taken). A load first: every look reads the flag, and
        // only the one that finds it set writes it (the swap: one caller wakes the thread).
        if s.asleep.load(Ordering::SeqCst) && s.asleep.swap(false, Ordering::SeqCst) {
            s.wake();
        }
        let Ok(mut c) = s.conn.try_lock() else { continue };
        match serve_some(inner, &mut c, Who::Caller) {
            Ok(true) if c.ahead.buffered() == 0 && c.out.is_empty() => {}
            // What is left (a payload still arriving is the next look's), or the stream's end,
            // is the thread's, which may be standing aside.
            Ok(_) => s.kick(),
            Err(e) => {
                tracing::debug!("tcp transport: closing a served connection: {e}");
                // Its thread, told even while it stands aside, sees the end and cleans up (a
                // flow ended for a broken protocol lingers there, for its last word to arrive).
                if c.ended.is_none() {
                    let _ = c.s.shutdown(std::net::Shutdown::Both);
                }
                s.kick();
            }
        }
    }
}

/// Handles the requests that have arrived on a flow (see `Conn::next` for what a caller
/// takes), and writes their replies; false at the end of the stream.
fn serve_some(inner: &Inner, c: &mut Conn, who: Who) -> std::io::Result<bool> {
    if let Some(why) = &c.ended {
        return Err(std::io::Error::other(why.clone()));
    }
    c.who = who;
    c.quota = if who == Who::Caller { CALLER_QUOTA } else { usize::MAX };
    c.budget = if who == Who::Caller { CALLER_BYTES } else { usize::MAX };
    loop {
        // A write a caller left part-received comes first: the flow's order.
        if !c.land(inner)? {
            return Ok(true);
        }
        let h = match c.next(inner)? {
            Arrived::Request(h) => h,
            Arrived::Empty => return Ok(true),
            Arrived::End => return Ok(false),
        };
        let write = match h.op {
            Op::Write => true,
            Op::Read => false,
            Op::Atomic => {
                atomic(inner, c, &h)?;
                continue;
            }
            Op::Fence if h.length == 0 => {
                // Everything before it on this flow has been served (in order, by this loop).
                let answer = Header { flags: 0, ..h };
                c.send(inner, &answer, &[])?;
                continue;
            }
            other => return Err(c.violation(inner, format!("unexpected {other:?} frame from the initiator"))),
        };
        let reg = inner.table.read().unwrap_or_else(|p| p.into_inner()).get(&h.buffer).cloned();
        let access = match reg {
            Some(r) => r.check_access(&h.key, h.remote_offset, h.length, write).map(|()| r),
            None => Err("unknown remote buffer".to_string()),
        };
        if write {
            // Its payload, accepted or not, is received next (the loop's `land`), and the write
            // answered then (a posted one only if refused).
            c.landing = Some(Landing { h, dst: access, done: 0 });
            continue;
        }
        match access {
            Ok(reg) => {
                // SAFETY: check_access put [offset, offset+length) inside the registration,
                // whose storage `reg` keeps alive; the bytes are only read. (A posted read
                // makes no sense: it is answered as any other.)
                let src = unsafe {
                    std::slice::from_raw_parts(reg.ptr().add(h.remote_offset as usize).cast_const(), h.length as usize)
                };
                c.reply(inner, &h, Op::Data, src)?;
            }
            Err(msg) => c.refuse(inner, &h, &msg)?,
        }
    }
}

/// Performs an ATOMIC request on a registered word and answers it.
fn atomic(inner: &Inner, c: &mut Conn, h: &Header) -> std::io::Result<()> {
    let refuse = |c: &mut Conn, msg: &str| c.refuse(inner, h, msg);
    let op = match Atomic::from_byte(h.status) {
        Some(Atomic::SlotPut) => crate::transport::Atomic::SlotPut,
        Some(Atomic::Set32) => crate::transport::Atomic::Set32,
        Some(Atomic::Set64) => crate::transport::Atomic::Set64,
        None => return refuse(c, &format!("unknown remote atomic {}", h.status)),
    };
    if h.length != op.width() {
        return refuse(c, &format!("a {op:?} acts on an aligned {}-byte word", op.width()));
    }
    let reg = inner.table.read().unwrap_or_else(|p| p.into_inner()).get(&h.buffer).cloned();
    let Some(reg) = reg else { return refuse(c, "unknown remote buffer") };
    if h.flags & POSTED != 0 && op == crate::transport::Atomic::SlotPut {
        return refuse(c, "a slot put is always answered (it may find the slot busy); it cannot be posted");
    }
    match crate::transport::target::apply_atomic(&reg, &h.key, h.remote_offset, op, h.cookie) {
        // Posted: a store, answered only if refused.
        Ok(_) if h.flags & POSTED != 0 => Ok(()),
        Ok(busy) => {
            let ack = Header { op: Op::Ack, status: if busy { ATOMIC_BUSY } else { 0 }, ..*h };
            c.send(inner, &ack, &[])
        }
        Err(msg) => refuse(c, &msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;
    use crate::transport::{Options, Transport};
    use crate::wire::tcp::Op;

    /// A write's payload is received as it arrives, by whoever looks at the flow (a caller at
    /// most [`CALLER_BYTES`] per look), and nobody waits for the rest while holding the flow: a
    /// look returns with the write part-received and the next one goes on, in the flow's order
    /// (the writes after it, their answers, a refused write's payload dropped and answered).
    #[test]
    fn a_write_is_received_as_it_arrives_by_whoever_looks_next() {
        let backend = super::super::TcpBackend::new(&Options::new()).unwrap();
        let inner = backend.inner.clone();
        let t = Transport::new(Box::new(backend), None);
        const N: usize = 512 * 1024;
        let dst = Tensor::zeros(&[N], crate::tensor::DType::U8).unwrap();
        let d = t.register_memory(&dst).unwrap().to_remote_buffer().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, from) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let mut c = Conn::new(s, from, None);
        let write = |id: u64, at: usize, len: usize, key: [u8; 16]| {
            Header {
                op: Op::Write,
                status: 0,
                flags: 0,
                request: id,
                cookie: 0,
                buffer: d.buffer_id,
                key,
                remote_offset: at as u64,
                length: len as u64,
            }
            .encode()
        };
        let bytes = |id: u8, len: usize| -> Vec<u8> { (0..len).map(|i| (i % 251) as u8 ^ id).collect() };
        // Until `n` bytes wait unread on the served socket.
        let arrived = |c: &Conn, n: usize| {
            let start = Instant::now();
            while rustix::io::ioctl_fionread(&c.s).unwrap() < n as u64 {
                assert!(start.elapsed() < Duration::from_secs(10), "{n} bytes never arrived");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let landed = |at: usize, want: &[u8]| dst.to_vec::<u8>().unwrap()[at..at + want.len()] == *want;

        // Write 1 (64 KiB at 0): its header and 10 KiB, then a look by a caller.
        let one = bytes(1, 64 << 10);
        peer.write_all(&write(1, 0, one.len(), d.access_key)).unwrap();
        peer.write_all(&one[..10 << 10]).unwrap();
        arrived(&c, HEADER_LEN + (10 << 10));
        assert!(serve_some(&inner, &mut c, Who::Caller).unwrap());
        assert_eq!(c.landing.as_ref().map(|l| l.done), Some(10 << 10), "the caller took what had arrived");
        assert!(landed(0, &one[..10 << 10]) && landed(10 << 10, &[0u8; 1024]));
        // The flow's thread looks while nothing more came: it returns, not waiting for the peer.
        let start = Instant::now();
        assert!(serve_some(&inner, &mut c, Who::Thread).unwrap());
        assert!(start.elapsed() < Duration::from_millis(500), "the thread waited for the payload");
        assert_eq!(c.landing.as_ref().map(|l| l.done), Some(10 << 10));

        // The rest of write 1, write 2 (a wrong key: refused, its 20 KiB dropped) and write 3
        // (384 KiB at 64 KiB): a caller's look receives at most its budget.
        let three = bytes(3, 384 << 10);
        let mut rest = one[10 << 10..].to_vec();
        rest.extend_from_slice(&write(2, 0, 20 << 10, [7; 16]));
        rest.extend_from_slice(&bytes(2, 20 << 10));
        rest.extend_from_slice(&write(3, 64 << 10, three.len(), d.access_key));
        rest.extend_from_slice(&three);
        let all = rest.len();
        let writer = std::thread::spawn(move || peer.write_all(&rest).map(|()| peer));
        arrived(&c, 96 << 10);
        assert!(serve_some(&inner, &mut c, Who::Caller).unwrap());
        let done = c.landing.as_ref().map_or(0, |l| l.done);
        assert!(landed(0, &one), "write 1 was not completed first");
        assert_eq!(c.landing.as_ref().map(|l| l.h.request), Some(3), "the caller stopped before write 3");
        // 54 KiB of write 1, 20 KiB dropped, and write 3's bytes: at most the budget.
        assert!((54 << 10) + (20 << 10) + done <= CALLER_BYTES, "{done} bytes of write 3 in one look");
        // The next looks go on where it stopped.
        let start = Instant::now();
        while c.landing.is_some() {
            assert!(start.elapsed() < Duration::from_secs(10), "write 3 never completed");
            serve_some(&inner, &mut c, Who::Caller).unwrap();
        }
        assert!(landed(64 << 10, &three), "write 3's bytes");
        assert!(landed(0, &one), "the refused write touched memory");
        let mut peer = writer.join().unwrap().unwrap();
        assert!(all > CALLER_BYTES);
        // Answers, in order: 1 accepted, 2 refused with the reason, 3 accepted.
        let start = Instant::now();
        while !c.out.is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "the answers are never written");
            c.flush(&inner).unwrap();
        }
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut answer = || {
            let mut hdr = [0u8; HEADER_LEN];
            peer.read_exact(&mut hdr).unwrap();
            let h = Header::decode(&hdr).unwrap();
            let mut msg = vec![0u8; if h.op == Op::Error { h.length as usize } else { 0 }];
            peer.read_exact(&mut msg).unwrap();
            (h.op, h.request, String::from_utf8(msg).unwrap())
        };
        assert_eq!(answer(), (Op::Ack, 1, String::new()));
        let (op, id, why) = answer();
        assert_eq!((op, id), (Op::Error, 2));
        assert!(why.contains("unknown remote buffer"), "{why}");
        assert_eq!(answer(), (Op::Ack, 3, String::new()));
    }

    /// A caller serving a flow answers small reads, at most [`CALLER_QUOTA`] requests per look,
    /// and a peer that sends read after read and never reads the answers cannot make it gather
    /// more than [`CALLER_OUT_MAX`] (plus one answer): it stops taking reads, which the flow's
    /// thread then serves as the socket takes them.
    #[test]
    fn a_serving_caller_takes_a_bounded_share_of_a_peers_reads() {
        let backend = super::super::TcpBackend::new(&Options::new()).unwrap();
        let inner = backend.inner.clone();
        let t = Transport::new(Box::new(backend), None);
        const N: usize = 16 * 1024;
        let src = Tensor::from_slice(&[N], &(0..N).map(|i| (i % 251) as u8).collect::<Vec<_>>()).unwrap();
        let d = t.register_memory_read_only(&src).unwrap().to_remote_buffer().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, from) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let mut c = Conn::new(s, from, None);
        // 2000 reads of 16 KiB: 32 MiB of answers, more than the sockets hold.
        let reads = 2000u64;
        let frames: Vec<u8> = (1..=reads)
            .flat_map(|id| {
                Header {
                    op: Op::Read,
                    status: 0,
                    flags: 0,
                    request: id,
                    cookie: 0,
                    buffer: d.buffer_id,
                    key: d.access_key,
                    remote_offset: 0,
                    length: N as u64,
                }
                .encode()
            })
            .collect();
        peer.write_all(&frames).unwrap();
        let mut fds = [PollFd::new(&c.s, PollFlags::IN)];
        poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 10, tv_nsec: 0 })).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut looks = 0;
        loop {
            let before = c.taken;
            serve_some(&inner, &mut c, Who::Caller).unwrap();
            let took = c.taken - before;
            // The promise in numbers (not the constants, which a change could lift).
            assert!(took <= 64, "a look took {took} requests");
            assert!(c.out.len() <= 64 * 1024 + N + HEADER_LEN, "{} bytes of answers gathered", c.out.len());
            looks += 1;
            if took == 0 {
                break;
            }
            assert!(looks < 1000, "the caller never stops taking requests");
        }
        // (It stopped once the sockets held what they take: 32 MiB is more than they do.)
        assert!(c.taken > 0, "the caller answered none of the reads");
        // The peer reads: every answer taken so far arrives, in order and right, as the
        // gathered rest is written (by the flow's thread, in the transport; here, this test).
        let answered = c.taken;
        let reader = std::thread::spawn(move || {
            let (mut hdr, mut payload) = ([0u8; HEADER_LEN], vec![0u8; N]);
            peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            for id in 1..=answered {
                peer.read_exact(&mut hdr).unwrap();
                let h = Header::decode(&hdr).unwrap();
                assert_eq!((h.op, h.request, h.length), (Op::Data, id, N as u64), "answer {id}");
                peer.read_exact(&mut payload).unwrap();
                assert!(payload.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8), "answer {id}'s bytes");
            }
        });
        let start = Instant::now();
        while !c.out.is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "the gathered answers are never written");
            c.flush(&inner).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        reader.join().unwrap();
    }
}
