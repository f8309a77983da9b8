//! The target's side of the `tcp` backend: accepting flows (every handshake at once, on the
//! accept thread, bounded in number and time), then serving each on a thread of its own.
//!
//! A connection gets a thread only after its handshake succeeded: until then it is one entry
//! in the accept thread's poll set, at most [`MAX_PENDING`] of them (a new one closes the
//! oldest), each given [`HANDSHAKE_TIME`] at most. At most [`MAX_SERVED`] flows are served at
//! once. A client of another user on this host is refused from its socket's credentials.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};

use super::{CLIENT_PROOF, Inner, MAX_CHUNK, MAX_FLOWS, SERVER_PROOF, lock, tune};
use crate::wire::tcp::{
    ATOMIC_BUSY, Atomic, Auth, Challenge, HEADER_LEN, HELLO_LEN, Header, Hello, MAX_ERROR_LEN, Op, PROOF_LEN, Refused,
    transcript,
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
    /// Once the hello is in: it, and the nonce this side answered with.
    hello: Option<(Hello, [u8; 32])>,
}

/// What to do with a pending connection after reading from it.
enum Next {
    Wait,
    Drop(String),
    Serve,
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
                Next::Serve => start_serving(&inner, p.stream),
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
            p.hello = Some((hello, challenge.nonce));
            Next::Wait
        }
        Some((hello, server_nonce)) => {
            let good = match &inner.opts.secret {
                Some(secret) => secret.check(CLIENT_PROOF, &[&transcript(&hello, &server_nonce)], &got),
                None => true,
            };
            let verdict = if good { 0 } else { Refused::BadProof as u8 };
            if !send(&p.stream, &[verdict]) || !good {
                return Next::Drop("a wrong proof of the job's secret".into());
            }
            Next::Serve
        }
    }
}

/// This side's answer to a hello, and whether it refuses the flow.
fn challenge(inner: &Inner, p: &Pending, hello: &Hello) -> (Challenge, Option<Refused>) {
    let auth = inner.opts.auth();
    let mut nonce = [0u8; 32];
    let refused = if getrandom::fill(&mut nonce).is_err() {
        Some(Refused::Busy)
    } else if p.stream.local_addr().is_ok_and(|l| crate::sys::peercred::same_user_or_remote(l, p.peer).is_err()) {
        Some(Refused::ForeignUser)
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
    let proof = match (&inner.opts.secret, hello.auth, refused) {
        (Some(secret), Auth::JobSecret, None) => secret.sign(SERVER_PROOF, &[&transcript(hello, &nonce)]),
        _ => [0u8; 32],
    };
    (Challenge { refused, auth, nonce, proof }, refused)
}

/// Writes a handshake message whole: a fresh socket's buffer takes it at once, or the peer is
/// not worth waiting for.
fn send(s: &TcpStream, bytes: &[u8]) -> bool {
    let mut s = s;
    s.write(bytes).is_ok_and(|n| n == bytes.len())
}

fn start_serving(inner: &Arc<Inner>, stream: TcpStream) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    tune(&stream, inner.opts.timeout);
    inner.serving.fetch_add(1, Ordering::Relaxed);
    let inner2 = inner.clone();
    let spawned = std::thread::Builder::new().name("symmem-tcp-serve".into()).spawn(move || {
        let inner = inner2;
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
        inner.serving.fetch_sub(1, Ordering::Relaxed);
    });
    if spawned.is_err() {
        inner.serving.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one flow that passed its handshake: requests in, replies out, until the peer closes
/// or breaks the protocol.
fn serve(inner: &Inner, mut s: &TcpStream) -> std::io::Result<()> {
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
    let op = match Atomic::from_byte(h.status) {
        Some(Atomic::SlotPut) => crate::transport::Atomic::SlotPut,
        Some(Atomic::Set32) => crate::transport::Atomic::Set32,
        Some(Atomic::Set64) => crate::transport::Atomic::Set64,
        None => return refuse(&format!("unknown remote atomic {}", h.status)),
    };
    if h.length != op.width() {
        return refuse(&format!("a {op:?} acts on an aligned {}-byte word", op.width()));
    }
    let reg = inner.table.read().unwrap_or_else(|p| p.into_inner()).get(&h.buffer).cloned();
    let Some(reg) = reg else { return refuse("unknown remote buffer") };
    match crate::transport::target::apply_atomic(&reg, &h.key, h.remote_offset, op, h.cookie) {
        Ok(busy) => {
            let ack = Header { op: Op::Ack, status: if busy { ATOMIC_BUSY } else { 0 }, ..*h };
            write_frame(s, &ack, &[])
        }
        Err(msg) => refuse(&msg),
    }
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
