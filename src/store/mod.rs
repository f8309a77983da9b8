//! The rendezvous key-value store: the [`Store`] trait, the TCP server and client that speak
//! PyTorch's TCPStore protocol, an in-process [`MemoryStore`] for tests, and [`PrefixStore`].
//!
//! Layer: uses `wire` only; never unsafe.

#![forbid(unsafe_code)]

mod auth;
mod client;
mod server;
mod state;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::wire::store::Limits;
pub use auth::{Secret, SecretSource};
pub use client::{
    AsyncStoreClient, BlockingConn, ClientOptions, Conn, DEFAULT_TIMEOUT, StoreClient, TcpStore, TokioConn,
};
pub use server::{ServerOptions, StoreServer};

use crate::error::{Error, Result};
use state::State;

/// Warns, once per process, that the job's store at `addr` is not authenticated when a rank
/// joins it without a secret (under torchrun, or `symmem run --no-auth`), naming what that
/// exposes and the setting that closes what can be closed.
pub fn warn_if_unauthenticated(addr: &str, options: &ClientOptions) {
    if options.secret.is_none() {
        warn_unauthenticated(addr);
    }
}

fn warn_unauthenticated(addr: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let links = if Secret::job_from_env().is_some() {
            "symmem's links between ranks still require the job's secret (SYMMEM_JOB_SECRET)".to_string()
        } else {
            format!(
                "and symmem's links between ranks accept any process that presents their URL from it, so it can \
                 read and write the ranks' registered and symmetric memory; set {job} to one random value \
                 on every rank (e.g. `export {job}=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')`) \
                 to require it on the links",
                job = crate::config::env::JOB_SECRET
            )
        };
        let msg = format!(
            "the job's store at {addr} is not authenticated (PyTorch's TCPStore, torchrun's, or `symmem run \
             --no-auth`): any process that can reach it can read and change the job's keys; {links}. Other users' \
             processes on this host are refused by symmem's own endpoints in any case. `symmem run` authenticates its \
             store by default"
        );
        // A program with no log subscriber still hears of it.
        if tracing::dispatcher::has_been_set() {
            tracing::warn!("{msg}");
        } else {
            #[allow(clippy::print_stderr, reason = "a security warning must reach a program that logs nothing")]
            {
                eprintln!("symmem: warning: {msg}");
            }
        }
    });
}

/// A key-value store shared by the ranks of a job: the rendezvous point of every group.
///
/// Keys are strings and values bytes. Every operation is bounded in time: those that wait for
/// keys take an explicit timeout (or [`Store::timeout`]), and the rest fail within the store's
/// timeout if the server stops answering.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Sets `key` to `value`, waking everyone waiting for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits up to `timeout` for `key` to exist, then returns its value.
    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer stored (as ASCII decimal) at `key`; absent counts as 0.
    /// Returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Replaces the value at `key` with `desired` if it equals `expected` (an absent key
    /// matches an empty `expected`); returns the value now stored. As in PyTorch, an absent key
    /// with a non-empty `expected` stores nothing and returns `expected`.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Waits up to `timeout` until every key exists.
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key exists, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// The number of keys in the whole store (every prefix).
    fn num_keys(&self) -> Result<i64>;

    /// Waits up to `timeout` for every key, then returns their values in order.
    fn multi_get_timeout(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Sets several keys at once.
    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()>;

    /// Appends `value` to the value at `key`, creating it if absent.
    fn append(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The default timeout of waiting operations.
    fn timeout(&self) -> Duration;

    /// One member's arrival at a barrier: deletes the `forget` keys, sets `arrive`, and waits
    /// up to `timeout` until every key of `all` exists. A TCP store sends all of it at once and
    /// waits for the replies: one round trip, on any TCPStore server.
    fn arrive_and_wait(&self, forget: &[&str], arrive: &str, all: &[&str], timeout: Duration) -> Result<()> {
        for k in forget {
            self.delete(k)?;
        }
        self.set(arrive, b"")?;
        self.wait_timeout(all, timeout)
    }

    /// Deletes every key of `keys` (those that do not exist are skipped). A TCP store sends
    /// every deletion at once and then reads the replies: one round trip.
    fn delete_many(&self, keys: &[&str]) -> Result<()> {
        for k in keys {
            self.delete(k)?;
        }
        Ok(())
    }

    /// [`Store::get_timeout`] with the default timeout.
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout())
    }

    /// [`Store::wait_timeout`] with the default timeout.
    fn wait(&self, keys: &[&str]) -> Result<()> {
        self.wait_timeout(keys, self.timeout())
    }

    /// [`Store::multi_get_timeout`] with the default timeout.
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.multi_get_timeout(keys, self.timeout())
    }
}

/// A store inside one process, with the same semantics as the TCP store: for tests, and for
/// single-process groups.
///
/// ```
/// use symmem::store::{MemoryStore, Store};
///
/// let store = MemoryStore::new();
/// assert_eq!(store.add("n", 2)?, 2);
/// assert_eq!(store.get("n")?, b"2");
/// # Ok::<(), symmem::Error>(())
/// ```
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<StateBox>,
    changed: Condvar,
    timeout: Duration,
}

/// `State` has no `Debug` (it may hold megabytes); this wrapper prints a summary.
struct StateBox(State);

impl std::fmt::Debug for StateBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "State({} keys)", self.0.len())
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::with_timeout(DEFAULT_TIMEOUT)
    }
}

impl MemoryStore {
    /// An empty store with the default timeout.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// An empty store whose waits default to `timeout`.
    pub fn with_timeout(timeout: Duration) -> MemoryStore {
        MemoryStore { state: Mutex::new(StateBox(State::default())), changed: Condvar::new(), timeout }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StateBox> {
        // Every State operation leaves it consistent before anything can panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mutate<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let r = f(&mut self.lock().0);
        // Partner: the `wait_timeout` on this condvar in `wait_until`, which rechecks its keys.
        self.changed.notify_all();
        r
    }

    fn wait_until<T>(&self, keys: &[&str], timeout: Duration, f: impl FnOnce(&State) -> T) -> Result<T> {
        let deadline = crate::sync::deadline(timeout);
        let mut guard = self.lock();
        loop {
            if keys.iter().all(|k| guard.0.present(k.as_bytes())) {
                return Ok(f(&guard.0));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!("store keys {keys:?}"), timeout));
            }
            guard = self.changed.wait_timeout(guard, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.mutate(|s| s.set(key.as_bytes().to_vec(), value.to_vec().into(), &mut Vec::new()));
        Ok(())
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_until(&[key], timeout, |s| s.value(key.as_bytes()).unwrap_or_default().to_vec())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.mutate(|s| s.add(key.as_bytes().to_vec(), delta, &mut Vec::new()))
            .map_err(|e| Error::InvalidArgument(format!("add to store key {key:?}: {e}")))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        Ok(self
            .mutate(|s| s.compare_set(key.as_bytes().to_vec(), expected, desired.to_vec().into(), &mut Vec::new()))
            .to_vec())
    }

    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_until(keys, timeout, |_| ())
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let guard = self.lock();
        Ok(keys.iter().all(|k| guard.0.present(k.as_bytes())))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.mutate(|s| s.delete(key.as_bytes())))
    }

    fn num_keys(&self) -> Result<i64> {
        Ok(self.lock().0.len() as i64)
    }

    fn multi_get_timeout(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait_until(keys, timeout, |s| {
            keys.iter().map(|k| s.value(k.as_bytes()).unwrap_or_default().to_vec()).collect()
        })
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        self.mutate(|s| {
            for (k, v) in pairs {
                s.set(k.as_bytes().to_vec(), v.to_vec().into(), &mut Vec::new());
            }
        });
        Ok(())
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.mutate(|s| s.append(key.as_bytes().to_vec(), value, &mut Vec::new()))
            .map_err(|e| Error::InvalidArgument(format!("append to store key {key:?}: {e}")))
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// A view of a store in which every key is `prefix/key`, as torch's `PrefixStore` maps it:
/// each group talks through one, so groups never see each other's keys.
///
/// ```
/// use std::sync::Arc;
/// use symmem::store::{MemoryStore, PrefixStore, Store};
///
/// let base = Arc::new(MemoryStore::new());
/// let a = PrefixStore::new("group_a", base.clone());
/// a.set("rank0", b"x")?;
/// assert_eq!(base.get("group_a/rank0")?, b"x");
/// # Ok::<(), symmem::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Scopes `inner` under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get_timeout(&self.key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait_timeout(&refs(&self.keys(keys)), timeout)
    }

    fn arrive_and_wait(&self, forget: &[&str], arrive: &str, all: &[&str], timeout: Duration) -> Result<()> {
        self.inner.arrive_and_wait(&refs(&self.keys(forget)), &self.key(arrive), &refs(&self.keys(all)), timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(&refs(&self.keys(keys)))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Result<()> {
        self.inner.delete_many(&refs(&self.keys(keys)))
    }

    fn num_keys(&self) -> Result<i64> {
        self.inner.num_keys()
    }

    fn multi_get_timeout(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.inner.multi_get_timeout(&refs(&self.keys(keys)), timeout)
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let keys: Vec<String> = pairs.iter().map(|(k, _)| self.key(k)).collect();
        let pairs: Vec<(&str, &[u8])> = keys.iter().zip(pairs).map(|(k, (_, v))| (k.as_str(), *v)).collect();
        self.inner.multi_set(&pairs)
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.key(key), value)
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}
