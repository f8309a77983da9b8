//! The `auto` backend: composes the registry's member backends (`shm`, `ucx` where UCX has a
//! fabric other than its tcp transport, and `tcp`) and connects through the first that reaches
//! the peer: same-host backends first, when both ends share a host and the kernel lets them
//! share memory, a network backend otherwise (ucx when both ends have the fabric).
//!
//! `bind` binds every member and returns `auto://?shm=<url>&tcp=<url>` (each base64url, keyed by
//! member name); `connect` asks each member the peer offered whether it reaches the peer
//! ([`Backend::reaches`]), tries it, and falls back to the next with the reason kept for
//! [`Backend::describe`]. Registrations are exposed through every member, so the peer reaches
//! them whichever way it connected. It knows its members only through the registry.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::registry::{self, Caps};
use super::{Backend, MemoryView, Options, Registration, RemoteBuffer, Request};
use crate::error::{Completion, Error, Result};

/// `chosen` before a member connected.
const NONE: usize = usize::MAX;

struct Member {
    name: &'static str,
    /// Its place in the registry's order of preference.
    rank: usize,
    backend: Box<dyn Backend>,
}

/// The `auto` backend.
pub struct AutoBackend {
    /// Its registered name, as its descriptors carry it: `auto`, or `symmem` (the name PyTorch
    /// knows it by).
    name: &'static str,
    members: Vec<Member>,
    /// The member connected through.
    /// The index of the member connected through, or [`NONE`]: read on every transfer, so an
    /// atomic rather than a lock.
    chosen: AtomicUsize,
    /// Why members were passed over, with their place in the order of preference: at
    /// construction (unsupported here) or at connect.
    passed_over: Mutex<Vec<(usize, String)>>,
}

impl AutoBackend {
    /// A backend; each option goes to the members that take it (`timeout` to all; `flows`,
    /// `host`, `chunk_size`, `auth` to tcp). An option no member takes is an error.
    pub fn new(options: &Options) -> Result<AutoBackend> {
        AutoBackend::named("auto", options)
    }

    /// [`AutoBackend::new`], registered as `name` (its descriptors say so).
    pub fn named(name: &'static str, options: &Options) -> Result<AutoBackend> {
        let all: Vec<_> = registry::auto_members().collect();
        if let Some(k) = options.keys().find(|k| !all.iter().any(|(m, _)| m.options.contains(&k.as_str()))) {
            let known: Vec<_> = all.iter().flat_map(|(m, _)| m.options.iter().copied()).collect();
            return Err(Error::InvalidArgument(format!(
                "unknown auto transport option {k:?} (known: {})",
                dedup(known).join(", ")
            )));
        }
        let (mut members, mut passed_over) = (Vec::new(), Vec::new());
        for (rank, (m, build)) in all.into_iter().enumerate() {
            let own: Options = options
                .iter()
                .filter(|(k, _)| m.options.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match build(&own) {
                Ok(backend) if backend.supported() => members.push(Member { name: m.name, rank, backend }),
                Ok(backend) => {
                    backend.shutdown();
                    passed_over.push((rank, format!("{}: unsupported in this process", m.name)));
                }
                // A bad option value is the caller's to fix, not a reason to fall back.
                Err(e @ Error::InvalidArgument(_)) => return Err(e),
                Err(e) => passed_over.push((rank, format!("{}: {e}", m.name))),
            }
        }
        if members.is_empty() {
            return Err(Error::Unsupported {
                what: "the auto transport".into(),
                needs: format!("one working member backend ({})", reasons(&passed_over, usize::MAX)),
            });
        }
        Ok(AutoBackend { name, members, chosen: AtomicUsize::new(NONE), passed_over: Mutex::new(passed_over) })
    }

    fn chosen(&self) -> Option<&Member> {
        // Acquire: pairs with the Release store in `connect`, after the member connected.
        self.members.get(self.chosen.load(Ordering::Acquire))
    }

    fn pass_over(&self, m: &Member, why: String) {
        self.passed_over.lock().unwrap_or_else(|p| p.into_inner()).push((m.rank, format!("{}: {why}", m.name)));
    }
}

/// The reasons of the members passed over that rank before `before`, joined.
fn reasons(passed_over: &[(usize, String)], before: usize) -> String {
    passed_over.iter().filter(|(r, _)| *r < before).map(|(_, why)| why.as_str()).collect::<Vec<_>>().join("; ")
}

fn dedup(mut v: Vec<&str>) -> Vec<&str> {
    let mut seen = std::collections::HashSet::new();
    v.retain(|x| seen.insert(*x));
    v
}

fn decode(v: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(v).ok()
}

impl Backend for AutoBackend {
    fn name(&self) -> &str {
        self.name
    }

    fn caps(&self) -> Caps {
        // Before it connects, it promises nothing.
        self.chosen().map_or(Caps::NONE, |m| m.backend.caps())
    }

    fn bind(&self, timeout: Duration) -> Result<Vec<u8>> {
        let mut url = String::from("auto://?");
        for (i, m) in self.members.iter().enumerate() {
            if i > 0 {
                url.push('&');
            }
            url.push_str(&format!("{}={}", m.name, URL_SAFE_NO_PAD.encode(m.backend.bind(timeout)?)));
        }
        Ok(url.into_bytes())
    }

    fn connect(&self, url: &[u8], timeout: Duration) -> Result<()> {
        let bad = || Error::InvalidArgument(format!("invalid auto transport URL {:?}", String::from_utf8_lossy(url)));
        let s = std::str::from_utf8(url).map_err(|_| bad())?;
        let query = s.strip_prefix("auto://?").ok_or_else(bad)?;
        let mut offered: Vec<(&str, Vec<u8>)> = Vec::new();
        for kv in query.split('&') {
            let (name, v) = kv.split_once('=').ok_or_else(bad)?;
            if offered.iter().any(|(n, _)| *n == name) {
                return Err(bad());
            }
            // A member this build does not have (a newer peer's) is skipped, but must be well formed.
            offered.push((name, decode(v).ok_or_else(bad)?));
        }
        let mut last = None;
        for (i, m) in self.members.iter().enumerate() {
            let Some((_, peer)) = offered.iter().find(|(n, _)| *n == m.name) else { continue };
            if let Err(why) = m.backend.reaches(peer) {
                self.pass_over(m, why.to_string());
                continue;
            }
            match m.backend.connect(peer, timeout) {
                Ok(()) => {
                    self.chosen.store(i, Ordering::Release);
                    return Ok(());
                }
                Err(e) => {
                    tracing::info!("auto transport: {} refused: {e}", m.name);
                    self.pass_over(m, e.to_string());
                    last = Some(e);
                }
            }
        }
        // The last member's own error when one was tried (it says most), else why none could be.
        Err(last.unwrap_or_else(|| {
            let why = reasons(&self.passed_over.lock().unwrap_or_else(|p| p.into_inner()), usize::MAX);
            if offered.iter().any(|(n, _)| self.members.iter().any(|m| m.name == *n)) {
                Error::InvalidArgument(format!("no transport reaches the peer: {why}"))
            } else {
                bad()
            }
        }))
    }

    fn connected(&self) -> bool {
        self.chosen().is_some_and(|m| m.backend.connected())
    }

    fn expose(&self, reg: &Arc<Registration>) -> Result<()> {
        self.members.iter().try_for_each(|m| m.backend.expose(reg))
    }

    fn withdraw(&self, reg: &Registration) {
        self.members.iter().for_each(|m| m.backend.withdraw(reg));
    }

    fn submit(&self, req: Request) -> Result<()> {
        match self.chosen() {
            Some(m) => m.backend.submit(req),
            None => Err(Error::InvalidArgument("auto transport is not connected".into())),
        }
    }

    fn transfer_now(&self, write: bool, local: &MemoryView, remote: &RemoteBuffer) -> Option<Completion> {
        self.chosen()?.backend.transfer_now(write, local, remote)
    }

    fn hold(&self, on: bool) {
        if let Some(m) = self.chosen() {
            m.backend.hold(on);
        }
    }

    fn serve_arrived(&self) {
        if let Some(m) = self.chosen() {
            m.backend.serve_arrived();
        }
    }

    fn fence(&self, timeout: Duration) -> Result<()> {
        self.chosen().map_or(Ok(()), |m| m.backend.fence(timeout))
    }

    fn shutdown(&self) {
        self.members.iter().for_each(|m| m.backend.shutdown());
    }

    fn default_timeout(&self) -> Duration {
        self.members.iter().map(|m| m.backend.default_timeout()).max().unwrap_or(Duration::from_secs(30))
    }

    fn disconnect_reason(&self) -> Option<String> {
        self.chosen().and_then(|m| m.backend.disconnect_reason())
    }

    fn describe(&self) -> String {
        match self.chosen() {
            // Only the members it preferred to the one it took, and why not.
            Some(m) => {
                let passed = reasons(&self.passed_over.lock().unwrap_or_else(|p| p.into_inner()), m.rank);
                if passed.is_empty() {
                    format!("{} via {}", self.name, m.name)
                } else {
                    format!("{} via {} ({passed})", self.name, m.name)
                }
            }
            None => format!("{} (not connected)", self.name),
        }
    }
}
