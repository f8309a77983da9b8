//! The TCP store server: a thin tokio driver around [`State`](super::state::State).
//!
//! Each connection is one tokio task (thousands of clients need no thread each). A task reads
//! bytes, decodes whole requests, applies them to the shared state under a short lock and hands
//! every reply to the outgoing queue of the connection it is for, so a SET wakes waiters on
//! other connections at once. A connection that sends bytes that break the protocol is closed;
//! everyone else is unaffected.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::error::{Error, Result};
use crate::store::auth::Secret;
use crate::store::state::{ConnId, Outbox, Session, State};
use crate::wire::store::{Limits, Request};

/// How a server is configured.
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// Require clients to prove they hold this secret before any operation.
    pub secret: Option<Secret>,
    /// Size limits on keys, values and key counts; torch's libuv limits by default.
    pub limits: Limits,
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
    secret: Option<Secret>,
    limits: Limits,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("limits", &self.limits).finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Inner {
    state: State,
    conns: HashMap<ConnId, mpsc::UnboundedSender<Vec<u8>>>,
    next_conn: ConnId,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves on the shared background runtime.
    pub fn start(addr: &str, options: ServerOptions) -> Result<StoreServer> {
        crate::rt::block_on(Self::bind(addr, options))
    }

    /// Binds `addr` and serves on the current tokio runtime.
    pub async fn bind(addr: &str, options: ServerOptions) -> Result<StoreServer> {
        let listener =
            TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind store server to {addr}"), e))?;
        let local = listener.local_addr().map_err(|e| Error::io("read the store server's address", e))?;
        let (stop, stopped) = watch::channel(false);
        let shared =
            Arc::new(Shared { inner: Mutex::new(Inner::default()), secret: options.secret, limits: options.limits });
        tokio::spawn(accept_loop(listener, shared.clone(), stopped));
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

    /// Waits until the server is stopped (by [`StoreServer::stop`] from another handle, or
    /// forever when serving standalone).
    pub async fn serve_forever(&self) {
        let mut rx = self.stop.subscribe();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
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

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    // A panic while holding this lock would be a bug in State; the state is still usable
    // (every operation leaves it consistent before it can panic), so keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let id = {
                        let mut inner = lock(&shared.inner);
                        inner.next_conn += 1;
                        inner.next_conn
                    };
                    tokio::spawn(serve_conn(stream, peer, id, shared.clone(), stopped.clone()));
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

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    id: ConnId,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    lock(&shared.inner).conns.insert(id, tx);

    let writer = tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if wr.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });

    let mut session = Session::new(id);
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut out: Outbox = Vec::new();
    'conn: loop {
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(64 * 1024);
        }
        let n = tokio::select! {
            _ = stopped.changed() => break 'conn,
            n = rd.read_buf(&mut buf) => n,
        };
        match n {
            Ok(0) | Err(_) => break 'conn,
            Ok(_) => {}
        }
        let mut start = 0;
        while start < buf.len() {
            let (req, used) = match Request::decode(&buf[start..], &shared.limits) {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(%peer, "store: closing connection: {e}");
                    break 'conn;
                }
            };
            start += used;
            let mut inner = lock(&shared.inner);
            let inner = &mut *inner;
            if let Err(e) = session.on_request(req, &mut inner.state, shared.secret.as_ref(), &mut out) {
                tracing::warn!(%peer, "store: closing connection: {e}");
                out.clear();
                break 'conn;
            }
            for (conn, bytes) in out.drain(..) {
                if let Some(tx) = inner.conns.get(&conn) {
                    // A send fails only if that connection is closing; its replies are moot.
                    let _ = tx.send(bytes);
                }
            }
        }
        buf.drain(..start);
    }

    {
        let mut inner = lock(&shared.inner);
        inner.state.disconnect(id);
        inner.conns.remove(&id);
    }
    // With the sender gone the writer flushes what is queued and closes the socket.
    let _ = writer.await;
}
