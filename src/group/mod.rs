//! Who participates: a [`Group`] is a set of ranks with a name and a store scoped to it.
//!
//! A rank learns who it is from the environment variables torchrun and `symmem run` set
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), so
//! symmem programs run unchanged under either launcher. Under torchrun
//! (`TORCHELASTIC_USE_AGENT_STORE=True`) every rank is a client of the agent's store; otherwise
//! rank 0 hosts the store unless one is already listening there.
//!
//! Layer: uses `store`; never unsafe.

#![forbid(unsafe_code)]

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{self, Rendezvous, env};
use crate::error::{Error, Result};
use crate::store::{ClientOptions, PrefixStore, ServerOptions, Store, StoreServer, TcpStore};

/// Above this many ranks, `auto` rendezvous exchanges go through rank 0.
pub const GATHER_ABOVE: usize = 32;

fn gather_by_default(world_size: usize) -> bool {
    match config::rendezvous() {
        Rendezvous::Gather => true,
        Rendezvous::Store => false,
        Rendezvous::Auto => world_size > GATHER_ABOVE,
    }
}

/// The id of the next group made in this process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The name of the group of every rank.
pub const WORLD: &str = "world";

/// The prefix of every key symmem writes, so its keys never collide with PyTorch's in a shared
/// store.
const KEY_ROOT: &str = "symmem";

/// The identity of a rank, read from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK` (defaults to `RANK` when unset).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE` (defaults to `WORLD_SIZE` when unset).
    pub local_world_size: usize,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// Whether the launcher hosts the store (`TORCHELASTIC_USE_AGENT_STORE=True`).
    pub agent_store: bool,
}

impl RankEnv {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<RankEnv> {
        RankEnv::from_lookup(config::from_env)
    }

    /// Reads the variables through `lookup`, so tests need not touch the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<RankEnv> {
        let required = |var: &'static str| {
            lookup(var).ok_or_else(|| Error::Env { var, reason: "not set (run under `symmem run` or torchrun)".into() })
        };
        let number = |var: &'static str, s: String| -> Result<usize> {
            s.trim()
                .parse::<usize>()
                .map_err(|_| Error::Env { var, reason: format!("{s:?} is not a non-negative integer") })
        };
        let rank = number(env::RANK, required(env::RANK)?)?;
        let world_size = number(env::WORLD_SIZE, required(env::WORLD_SIZE)?)?;
        if world_size == 0 {
            return Err(Error::Env { var: env::WORLD_SIZE, reason: "must be at least 1".into() });
        }
        if rank >= world_size {
            return Err(Error::Env { var: env::RANK, reason: format!("{rank} is not below WORLD_SIZE {world_size}") });
        }
        let local_rank = lookup(env::LOCAL_RANK).map(|s| number(env::LOCAL_RANK, s)).transpose()?.unwrap_or(rank);
        let local_world_size =
            lookup(env::LOCAL_WORLD_SIZE).map(|s| number(env::LOCAL_WORLD_SIZE, s)).transpose()?.unwrap_or(world_size);
        if local_rank >= local_world_size {
            return Err(Error::Env {
                var: env::LOCAL_RANK,
                reason: format!("{local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}"),
            });
        }
        let master_addr = required(env::MASTER_ADDR)?;
        if master_addr.trim().is_empty() {
            return Err(Error::Env { var: env::MASTER_ADDR, reason: "is empty".into() });
        }
        let port = required(env::MASTER_PORT)?;
        let master_port = port.trim().parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| Error::Env {
            var: env::MASTER_PORT,
            reason: format!("{port:?} is not a port number (1-65535)"),
        })?;
        let agent_store = lookup(env::AGENT_STORE).is_some_and(|v| v == "True");
        Ok(RankEnv { rank, world_size, local_rank, local_world_size, master_addr, master_port, agent_store })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with IPv6 literals bracketed.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// The largest group whose barrier waits for every rank's arrival key in one request;
/// larger groups count arrivals, so that no request names more than this many keys.
pub const BARRIER_KEYS_MAX: usize = 64;

/// A set of ranks that communicate, with a store scoped to the group.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use symmem::{Group, store::MemoryStore};
///
/// let store = Arc::new(MemoryStore::new());
/// let ranks: Vec<_> = (0..3)
///     .map(|rank| {
///         let store = store.clone();
///         std::thread::spawn(move || {
///             let group = Group::new(rank, 3, store)?;
///             let all = group.all_gather_bytes("hello", format!("rank {rank}").as_bytes())?;
///             group.barrier(Duration::from_secs(10))?;
///             Ok::<_, symmem::Error>(all)
///         })
///     })
///     .collect();
/// for r in ranks {
///     let all = r.join().unwrap()?;
///     assert_eq!(all[2], b"rank 2");
/// }
/// # Ok::<(), symmem::Error>(())
/// ```
#[derive(Debug)]
pub struct Group {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    name: String,
    /// The global ranks of the members; this group's rank `i` is global rank `members[i]`.
    members: Vec<usize>,
    /// The store scoped to this group.
    store: Arc<dyn Store>,
    /// The unscoped store, from which sub-groups scope their own.
    root: Arc<dyn Store>,
    barriers: AtomicU64,
    gathers: AtomicU64,
    /// Whether rendezvous exchanges go through rank 0 ([`Group::set_gather_through_root`]).
    through_root: AtomicBool,
    splits: Mutex<HashMap<Vec<usize>, u64>>,
    /// Keys of this rank's last exchange that other ranks may still read (see `exchanged`).
    stale: Mutex<Vec<String>>,
    /// A number no other group of this process has, for caches that outlive the name.
    id: u64,
    /// What layers above keep per group, by type (see [`Group::state`]).
    /// One value per type; a handful of types, so a list scanned without hashing (the small
    /// all-reduce looks its workspace up on every call).
    state: Mutex<Vec<(TypeId, Arc<dyn Any + Send + Sync>)>>,
    /// The store server, when this rank hosts it; it lives as long as the group.
    _server: Option<Arc<StoreServer>>,
}

impl Group {
    /// The world group of this process, from the environment (see the module docs).
    pub fn from_env() -> Result<Group> {
        let env = RankEnv::from_env()?;
        let options = ClientOptions::from_env()?;
        Group::from_rank_env(&env, options)
    }

    /// The world group of a rank described by `env`.
    pub fn from_rank_env(env: &RankEnv, options: ClientOptions) -> Result<Group> {
        let addr = env.store_addr();
        let server = if env.rank == 0 && !env.agent_store {
            let opts = ServerOptions { secret: options.secret.clone(), ..ServerOptions::default() };
            match StoreServer::start(&addr, opts) {
                Ok(s) => Some(Arc::new(s)),
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
                    tracing::debug!("a store already listens at {addr}; connecting as a client");
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        crate::store::warn_if_unauthenticated(&addr, &options);
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&addr, options)?);
        let mut group = Group::with_name(env.rank, env.world_size, store, WORLD)?;
        group.local_rank = env.local_rank;
        group.local_world_size = env.local_world_size;
        group._server = server;
        Ok(group)
    }

    /// A group of `world_size` ranks named [`WORLD`], of which this is `rank`, meeting through
    /// `store`.
    pub fn new(rank: usize, world_size: usize, store: Arc<dyn Store>) -> Result<Group> {
        Group::with_name(rank, world_size, store, WORLD)
    }

    /// A group with an explicit name; groups with different names never see each other's keys.
    pub fn with_name(rank: usize, world_size: usize, store: Arc<dyn Store>, name: &str) -> Result<Group> {
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!("rank {rank} is not below world size {world_size}")));
        }
        Ok(Group::scoped(rank, (0..world_size).collect(), store, name.to_string()))
    }

    fn scoped(rank: usize, members: Vec<usize>, root: Arc<dyn Store>, name: String) -> Group {
        let world_size = members.len();
        let store = Arc::new(PrefixStore::new(format!("{KEY_ROOT}/{name}"), root.clone()));
        Group {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            name,
            members,
            store,
            root,
            barriers: AtomicU64::new(0),
            gathers: AtomicU64::new(0),
            through_root: AtomicBool::new(gather_by_default(world_size)),
            splits: Mutex::new(HashMap::new()),
            stale: Mutex::new(Vec::new()),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(Vec::new()),
            _server: None,
        }
    }

    /// A number that identifies this group among every group this process ever made (names
    /// can be reused after a group is dropped; ids are not).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// This group's state of type `T`, made (empty) at its first use: how the layers above
    /// keep what they need per group (symmetric memory's rendezvous steps, links to other
    /// hosts and barrier; the operators' workspaces) without process-wide maps. It lives
    /// exactly as long as the group: dropping the group drops it, which closes its links and
    /// frees its workspaces. `T` holds its own locks; this lock is held only for the lookup.
    pub fn state<T: Any + Send + Sync + Default>(&self) -> Arc<T> {
        let id = TypeId::of::<T>();
        let mut all = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let any = match all.iter().find(|(t, _)| *t == id) {
            Some((_, v)) => v.clone(),
            None => {
                let v: Arc<dyn Any + Send + Sync> = Arc::new(T::default());
                all.push((id, v.clone()));
                v
            }
        };
        drop(all);
        // The entry for T's TypeId was made as a T.
        any.downcast::<T>().unwrap_or_else(|_| unreachable!("group state keyed by its own type"))
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank's index among the ranks on its host (from `LOCAL_RANK`).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The number of ranks on this host (from `LOCAL_WORLD_SIZE`).
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// The group's name, unique among the groups of a job.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The store, scoped to this group.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// A sub-group of the given group ranks, in that order, with its own name and key prefix.
    ///
    /// Every member must call `split` with the same ranks, in the same order relative to its
    /// other splits of the same ranks; ranks outside `ranks` may call it too and get `None`.
    pub fn split(&self, ranks: &[usize]) -> Result<Option<Group>> {
        if ranks.is_empty() {
            return Err(Error::InvalidArgument("split of no ranks".into()));
        }
        let mut seen = vec![false; self.world_size];
        for &r in ranks {
            if r >= self.world_size {
                return Err(Error::InvalidArgument(format!(
                    "split rank {r} is not in group {:?} of {} ranks",
                    self.name, self.world_size
                )));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::InvalidArgument(format!("split lists rank {r} twice")));
            }
        }
        let n = {
            let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
            let n = splits.entry(ranks.to_vec()).or_insert(0);
            *n += 1;
            *n
        };
        let Some(my_index) = ranks.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let list = ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let name = format!("{}/split[{list}]#{n}", self.name);
        let members = ranks.iter().map(|&r| self.members[r]).collect();
        let g = Group::scoped(my_index, members, self.root.clone(), name);
        // A sub-group exchanges the way its parent does (every member agrees on that).
        g.set_gather_through_root(self.gather_through_root());
        Ok(Some(g))
    }

    /// Waits until every rank of the group has called `barrier` (the same number of times), or
    /// fails after `timeout` with an error naming the ranks that did not arrive.
    ///
    /// Up to [`BARRIER_KEYS_MAX`] ranks, one store round trip: each rank sets its arrival key
    /// and waits for all of them in one message (any TCPStore server answers it), deleting its
    /// key of two barriers ago on the way. Larger groups count arrivals instead (O(N) keys).
    pub fn barrier(&self, timeout: Duration) -> Result<()> {
        let seq = self.barriers.fetch_add(1, Ordering::Relaxed);
        let key = format!("barrier/{seq}");
        let outcome = if self.world_size <= BARRIER_KEYS_MAX {
            let all: Vec<String> = (0..self.world_size).map(|r| format!("{key}/{r}")).collect();
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            // This rank finished barrier `seq - 1`, so every rank arrived there, so every rank
            // finished waiting in `seq - 2`: its key is no longer waited on.
            let old = seq.checked_sub(2).map(|old| format!("barrier/{old}/{}", self.rank));
            let forget: Vec<&str> = old.iter().map(String::as_str).collect();
            self.store.arrive_and_wait(&forget, all[self.rank], &all, timeout)
        } else {
            self.counted_barrier(seq, &key, timeout)
        };
        match outcome {
            Err(e) if e.is_timeout() => Err(self.barrier_timeout(seq, timeout)),
            r => r,
        }
    }

    fn counted_barrier(&self, seq: u64, key: &str, timeout: Duration) -> Result<()> {
        let done = format!("{key}/done");
        self.store.set(&format!("{key}/{}", self.rank), b"")?;
        let arrived = self.store.add(key, 1)?;
        if arrived == self.world_size as i64 {
            // Every rank has finished barrier `seq - 1` before arriving here, so its keys are
            // no longer waited on.
            if seq > 0 {
                self.forget_barrier(seq - 1)?;
            }
            self.store.set(&done, b"")?;
        }
        self.store.wait_timeout(&[&done], timeout)
    }

    fn forget_barrier(&self, seq: u64) -> Result<()> {
        let key = format!("barrier/{seq}");
        self.store.delete(&key)?;
        self.store.delete(&format!("{key}/done"))?;
        for r in 0..self.world_size {
            self.store.delete(&format!("{key}/{r}"))?;
        }
        Ok(())
    }

    #[cold]
    fn barrier_timeout(&self, seq: u64, timeout: Duration) -> Error {
        let missing: Vec<usize> = (0..self.world_size)
            .filter(|r| !self.store.check(&[&format!("barrier/{seq}/{r}")]).unwrap_or(false))
            .collect();
        Error::timeout(
            format!(
                "barrier {seq} of group {:?}: rank(s) {missing:?} of {} did not arrive",
                self.name, self.world_size
            ),
            timeout,
        )
    }

    /// Every rank contributes `value`; every rank gets all values, indexed by rank, through the
    /// group's exchange: the store ([`Group::all_gather_bytes`], one set and one multi-get per
    /// rank) or, when [`Group::set_gather_through_root`] is on, a gather to rank 0 and a
    /// broadcast of one blob ([`Group::all_gather_bytes_through_root`]). Waits at most `timeout`
    /// for the other ranks. Symmetric-memory rendezvous uses this.
    pub fn exchange_bytes(&self, tag: &str, value: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if self.through_root.load(Ordering::Relaxed) {
            self.rooted_gather(tag, value, timeout)
        } else {
            self.gather(tag, value, timeout)
        }
    }

    /// Routes this group's rendezvous exchanges through rank 0 (PyTorch's
    /// `use_pg_for_symm_mem_rendezvous`, on a store): O(N) store requests in all instead of
    /// O(N²) key lookups. Every rank of the group must choose the same. The default comes from
    /// [`env::RENDEZVOUS`].
    pub fn set_gather_through_root(&self, on: bool) {
        self.through_root.store(on, Ordering::Relaxed);
    }

    /// Whether rendezvous exchanges go through rank 0.
    pub fn gather_through_root(&self) -> bool {
        self.through_root.load(Ordering::Relaxed)
    }

    /// An all-gather through rank 0: every other rank sets its value, rank 0 reads them all with
    /// one multi-get and publishes them as one blob, which every other rank reads with one get.
    /// Same result and ordering rules as [`Group::all_gather_bytes`].
    pub fn all_gather_bytes_through_root(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.rooted_gather(tag, value, self.store.timeout())
    }

    fn rooted_gather(&self, tag: &str, value: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let seq = self.gathers.fetch_add(1, Ordering::Relaxed);
        let prefix = format!("rooted/{seq}/{tag}");
        let all = format!("{prefix}/all");
        if self.rank != 0 {
            let mine = format!("{prefix}/{}", self.rank);
            self.store.set(&mine, value)?;
            let blob = self.store.get_timeout(&all, timeout).map_err(|e| match e {
                Error::Timeout { after, .. } => {
                    let missing: Vec<usize> = (1..self.world_size)
                        .filter(|r| !self.store.check(&[&format!("{prefix}/{r}")]).unwrap_or(false))
                        .collect();
                    Error::timeout(
                        format!(
                            "all-gather {tag:?} of group {:?} through rank 0: rank 0 published nothing (ranks \
                             {missing:?} did not contribute)",
                            self.name
                        ),
                        after,
                    )
                }
                e => e,
            })?;
            // Rank 0 read this rank's value before it published the blob.
            self.store.delete(&mine)?;
            self.exchanged(Vec::new())?;
            return crate::wire::symm::unpack_gathered(&blob, self.world_size)
                .map_err(|e| Error::Rendezvous(format!("all-gather {tag:?} of group {:?}: {e}", self.name)));
        }
        let keys: Vec<String> = (1..self.world_size).map(|r| format!("{prefix}/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut values = Vec::with_capacity(self.world_size);
        values.push(value.to_vec());
        if !refs.is_empty() {
            values.extend(self.store.multi_get_timeout(&refs, timeout).map_err(|e| match e {
                Error::Timeout { after, .. } => {
                    let missing: Vec<usize> =
                        (1..self.world_size).filter(|&r| !self.store.check(&[refs[r - 1]]).unwrap_or(false)).collect();
                    Error::timeout(
                        format!("all-gather {tag:?} of group {:?}: rank(s) {missing:?} did not contribute", self.name),
                        after,
                    )
                }
                e => e,
            })?);
        }
        // Every rank has finished the last exchange (each contributed to this one). The blob
        // is read by every other rank, and goes once the next exchange shows they have.
        self.exchanged(vec![all.clone()])?;
        if self.world_size > 1 {
            self.store.set(&all, &crate::wire::symm::pack_gathered(&values))?;
        }
        Ok(values)
    }

    /// Every rank contributes `value`; every rank gets all values, indexed by rank. `tag` names
    /// the exchange in errors; calls must happen in the same order on every rank.
    pub fn all_gather_bytes(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(tag, value, self.store.timeout())
    }

    fn gather(&self, tag: &str, value: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let seq = self.gathers.fetch_add(1, Ordering::Relaxed);
        let prefix = format!("gather/{seq}/{tag}");
        let mine = format!("{prefix}/{}", self.rank);
        self.store.set(&mine, value)?;
        let keys: Vec<String> = (0..self.world_size).map(|r| format!("{prefix}/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let values = self.store.multi_get_timeout(&refs, timeout).map_err(|e| match e {
            Error::Timeout { after, .. } => {
                let missing: Vec<usize> =
                    (0..self.world_size).filter(|&r| !self.store.check(&[refs[r]]).unwrap_or(false)).collect();
                Error::timeout(
                    format!("all-gather {tag:?} of group {:?}: rank(s) {missing:?} did not contribute", self.name),
                    after,
                )
            }
            e => e,
        })?;
        self.exchanged(vec![mine])?;
        Ok(values)
    }

    /// Called when an exchange has completed: every rank has then finished the exchange before
    /// it (each contributes to this one only after reading all of the last), so the keys this
    /// rank left for that one are read by everyone and can go. `keys` are this exchange's, left
    /// for the next call to delete. The store holds at most one exchange's keys per group.
    fn exchanged(&self, keys: Vec<String>) -> Result<()> {
        let mut stale = self.stale.lock().unwrap_or_else(|p| p.into_inner());
        let old = std::mem::take(&mut *stale);
        for k in &old {
            self.store.delete(k)?;
        }
        stale.extend(keys);
        Ok(())
    }
}

/// Runs `f` as the `n` ranks of one job on threads of this process, meeting through an
/// in-process store: for examples, tests and single-process experiments. Symmetric memory and
/// every operator work between such ranks as between processes.
///
/// Returns each rank's result in rank order, or the first rank's error (by rank); a rank's
/// panic resumes in the caller.
///
/// ```
/// let ranks = symmem::group::run_threads(3, |g| Ok(g.rank() * 10))?;
/// assert_eq!(ranks, [0, 10, 20]);
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn run_threads<T: Send>(n: usize, f: impl Fn(Group) -> Result<T> + Sync) -> Result<Vec<T>> {
    let store: Arc<dyn Store> = Arc::new(crate::store::MemoryStore::new());
    let f = &f;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let store = store.clone();
                s.spawn(move || f(Group::new(rank, n, store)?))
            })
            .collect();
        let joined: Vec<Result<T>> =
            ranks.into_iter().map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect();
        joined.into_iter().collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    const OK: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_torchrun_variables() {
        let e = RankEnv::from_lookup(env(OK)).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (1, 4, 1, 2));
        assert_eq!(e.store_addr(), "127.0.0.1:29500");
        assert!(!e.agent_store);
        let mut with_agent = OK.to_vec();
        with_agent.push((env::AGENT_STORE, "True"));
        assert!(RankEnv::from_lookup(env(&with_agent)).unwrap().agent_store);
    }

    #[test]
    fn errors_name_the_variable() {
        let cases: &[(&str, Option<&str>, &str)] = &[
            ("RANK", None, "RANK"),
            ("RANK", Some("x"), "RANK"),
            ("RANK", Some("4"), "RANK"),
            ("WORLD_SIZE", Some("0"), "WORLD_SIZE"),
            ("MASTER_PORT", Some("70000"), "MASTER_PORT"),
            ("MASTER_PORT", None, "MASTER_PORT"),
            ("MASTER_ADDR", None, "MASTER_ADDR"),
            ("LOCAL_RANK", Some("-1"), "LOCAL_RANK"),
            ("LOCAL_RANK", Some("2"), "LOCAL_RANK"),
        ];
        for (var, value, named) in cases {
            let mut pairs: Vec<(&str, &str)> = OK.iter().filter(|(k, _)| k != var).copied().collect();
            if let Some(v) = value {
                pairs.push((var, v));
            }
            let err = RankEnv::from_lookup(env(&pairs)).unwrap_err();
            assert!(matches!(&err, Error::Env { var, .. } if var == named), "{var}={value:?}: {err}");
            assert!(err.to_string().contains(named), "{err}");
        }
    }

    fn run_ranks<T: Send + 'static>(n: usize, f: impl Fn(Group) -> T + Send + Sync + 'static) -> Vec<T> {
        run_ranks_on(n, Arc::new(MemoryStore::new()), f)
    }

    fn run_ranks_on<T: Send + 'static>(
        n: usize,
        store: Arc<dyn Store>,
        f: impl Fn(Group) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (store, f) = (store.clone(), f.clone());
                std::thread::spawn(move || f(Group::new(r, n, store).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn barrier_and_gather_across_threads() {
        let results = run_ranks(4, |g| {
            let mut seen = Vec::new();
            for round in 0..20u32 {
                g.barrier(Duration::from_secs(10)).unwrap();
                let all = g.all_gather_bytes("round", &(round * 10 + g.rank() as u32).to_le_bytes()).unwrap();
                seen.push(all);
            }
            seen
        });
        for seen in results {
            for (round, all) in seen.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..4u32).map(|r| (round as u32 * 10 + r).to_le_bytes().to_vec()).collect();
                assert_eq!(all, &want);
            }
        }
    }

    #[test]
    fn gathers_through_rank_0_give_the_same_results() {
        let results = run_ranks(5, |g| {
            g.set_gather_through_root(true);
            let sub = g.split(&[4, 1, 2]).unwrap();
            let mut seen = Vec::new();
            for round in 0..10u32 {
                let mine = vec![g.rank() as u8; (round as usize * 7 + g.rank()) % 13];
                let t = Duration::from_secs(10);
                assert_eq!(g.exchange_bytes("round", &mine, t).unwrap(), g.all_gather_bytes("round", &mine).unwrap());
                seen.push(g.exchange_bytes("again", &mine, t).unwrap());
            }
            if let Some(sub) = sub {
                assert!(sub.gather_through_root(), "sub-groups inherit the choice");
                let all = sub.exchange_bytes("sub", &[sub.rank() as u8], Duration::from_secs(10)).unwrap();
                assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
            }
            seen
        });
        for seen in results {
            for (round, all) in seen.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..5).map(|r| vec![r as u8; (round * 7 + r) % 13]).collect();
                assert_eq!(all, &want);
            }
        }
    }

    #[test]
    fn a_gather_through_rank_0_names_who_is_missing() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::with_timeout(Duration::from_millis(200)));
        let g0 = Group::new(0, 3, store.clone()).unwrap();
        let g1 = Group::new(1, 3, store).unwrap();
        let t = std::thread::spawn(move || g1.all_gather_bytes_through_root("x", b"1").unwrap_err().to_string());
        let e0 = g0.all_gather_bytes_through_root("x", b"0").unwrap_err().to_string();
        assert!(e0.contains("rank(s) [2] did not contribute"), "{e0}");
        let e1 = t.join().unwrap();
        assert!(e1.contains("rank 0 published nothing") && e1.contains("[2]"), "{e1}");
    }

    #[test]
    fn barriers_clean_up_their_keys() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let g = Group::new(0, 1, s).unwrap();
        for _ in 0..100 {
            g.barrier(Duration::from_secs(1)).unwrap();
        }
        // The arrival keys of the last two barriers.
        assert!(store.num_keys().unwrap() <= 2, "{} keys left", store.num_keys().unwrap());
    }

    #[test]
    fn barriers_of_many_ranks_count_arrivals_and_clean_up() {
        let n = BARRIER_KEYS_MAX + 1;
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        run_ranks_on(n, s, |g| {
            for _ in 0..5 {
                g.barrier(Duration::from_secs(30)).unwrap();
            }
        });
        // The last barrier's count, arrivals and done key.
        let left = store.num_keys().unwrap() as usize;
        assert!(left <= n + 2, "{left} keys left");
    }

    #[test]
    fn exchanges_leave_at_most_one_exchange_of_keys() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let t = Duration::from_secs(10);
        run_ranks_on(3, s, move |g| {
            for round in 0..300u32 {
                g.set_gather_through_root(round % 3 == 0);
                let all = g.exchange_bytes("x", &[g.rank() as u8], t).unwrap();
                assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
            }
            g.barrier(t).unwrap();
        });
        // The last exchange's keys (3 at most) and the last barrier's arrivals (3).
        let left = store.num_keys().unwrap();
        assert!(left <= 6, "{left} keys left after 300 exchanges");
    }

    #[test]
    fn barrier_timeout_names_missing_ranks() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let g0 = Group::new(0, 3, store.clone()).unwrap();
        let g2 = Group::new(2, 3, store).unwrap();
        let t = std::thread::spawn(move || g2.barrier(Duration::from_millis(300)));
        let err = g0.barrier(Duration::from_millis(300)).unwrap_err();
        assert!(err.is_timeout());
        assert!(err.to_string().contains("[1]"), "{err}");
        assert!(t.join().unwrap().unwrap_err().to_string().contains("[1]"));
    }

    #[test]
    fn split_scopes_keys_and_renumbers() {
        let results = run_ranks(4, |g| {
            let odd = g.split(&[3, 1]).unwrap();
            let even = g.split(&[0, 2]).unwrap();
            let sub = odd.or(even).unwrap();
            let all = sub.all_gather_bytes("x", g.rank().to_string().as_bytes()).unwrap();
            sub.barrier(Duration::from_secs(10)).unwrap();
            (g.rank(), sub.rank(), sub.world_size(), sub.members().to_vec(), all)
        });
        for (rank, sub_rank, size, members, all) in results {
            assert_eq!(size, 2);
            assert_eq!(members[sub_rank], rank);
            let want: Vec<Vec<u8>> = members.iter().map(|m| m.to_string().into_bytes()).collect();
            assert_eq!(all, want);
        }
        let g = Group::new(0, 2, Arc::new(MemoryStore::new())).unwrap();
        assert!(g.split(&[0, 0]).is_err());
        assert!(g.split(&[2]).is_err());
        assert!(g.split(&[]).is_err());
        assert!(g.split(&[1]).unwrap().is_none());
    }
}
