//! Which backends exist, what each can do, and how to build one.
//!
//! Built-in backends are listed once, in [`BUILT_IN`], with their declared [`Caps`]: layers
//! above pick a backend by capability ([`pick`]), never by name, and `auto` composes the
//! backends marked as its members by asking them ([`Backend::reaches`], [`Backend::caps`])
//! instead of importing them. Adding a backend touches its own folder and one line here.
//! Applications may register more backends at run time ([`register_transport`]).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Backend, Options, auto, shm, tcp, ucx};
use crate::error::{Error, Result};

/// Builds a backend from options.
pub type Factory = Arc<dyn Fn(&Options) -> Result<Box<dyn Backend>> + Send + Sync>;

/// Which peers a backend can reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Only processes on this host (shared memory).
    SameHost,
    /// Processes on any host (a network).
    AnyHost,
}

/// What a backend can do. Layers above choose a backend and an algorithm from these, so a
/// backend's behaviour that others rely on is stated here and nowhere else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Remote atomics on one word ([`super::Atomic`]): symmetric memory signals peers on
    /// other hosts with them. Without, a transport refuses them when asked.
    pub remote_atomics: bool,
    /// Transfers of at most this many bytes, started in order on one transport, take effect
    /// in the peer's memory in that order, so a remote atomic started after them lands after
    /// them. 0: no order is promised; wait for each transfer before the next depends on it.
    pub in_order_up_to: usize,
    /// Which peers it can reach.
    pub reach: Reach,
}

impl Caps {
    /// Nothing promised: no atomics, no order, any host (a backend registered at run time).
    pub const NONE: Caps = Caps { remote_atomics: false, in_order_up_to: 0, reach: Reach::AnyHost };
}

/// How a backend is built.
pub(crate) type Build = fn(&Options) -> Result<Box<dyn Backend>>;

/// A backend that ships with symmem.
pub(crate) struct BuiltIn {
    /// Its name (lower case).
    pub(crate) name: &'static str,
    /// What it can do, before any instance exists.
    pub(crate) caps: Caps,
    /// The options it takes (`auto` hands each member the ones it takes).
    pub(crate) options: &'static [&'static str],
    /// Builds one, as its name asks.
    pub(crate) build: Build,
    /// Whether symmem picks it by itself (as a member of `auto`, and for symmetric memory's
    /// links between hosts), and how; `auto` prefers same-host members, then this order.
    pub(crate) by_itself: Option<ByItself>,
    /// Whether `SYMMEM_XHOST_BACKEND` naming it puts it, built as named, first among `auto`'s
    /// network members.
    pub(crate) opt_in: bool,
}

/// How symmem uses a backend it picks by itself.
pub(crate) struct ByItself {
    /// Whether it may here, or why not (ucx: only over a fabric other than UCX's tcp).
    pub(crate) usable: fn() -> std::result::Result<(), String>,
    /// Builds one for that use.
    pub(crate) build: Build,
}

const ALWAYS: fn() -> std::result::Result<(), String> = || Ok(());
const SHM: Build = |o| Ok(Box::new(shm::ShmBackend::new(o)?));
const TCP: Build = |o| Ok(Box::new(tcp::TcpBackend::new(o)?));

/// Every built-in backend. `auto` (and its alias `symmem`, the name PyTorch knows symmem by)
/// composes the members; it declares nothing of its own, since what it can do is its chosen
/// member's.
pub(crate) const BUILT_IN: &[BuiltIn] = &[
    BuiltIn {
        name: "shm",
        caps: shm::CAPS,
        options: shm::OPTIONS,
        build: SHM,
        by_itself: Some(ByItself { usable: ALWAYS, build: SHM }),
        opt_in: false,
    },
    // Before tcp: where the fabric has RDMA, it is the better engine. Picked by itself only
    // without UCX's tcp transport, whose PUT writes wherever a connected peer names (UCX does
    // not authenticate who connects); named, it runs on whatever UCX_TLS allows.
    BuiltIn {
        name: "ucx",
        caps: ucx::CAPS,
        options: ucx::OPTIONS,
        build: |o| Ok(Box::new(ucx::UcxBackend::new(o)?)),
        by_itself: Some(ByItself {
            usable: || ucx::fabric().map(drop),
            build: |o| Ok(Box::new(ucx::UcxBackend::fabric_only(o)?)),
        }),
        opt_in: true,
    },
    BuiltIn {
        name: "tcp",
        caps: tcp::CAPS,
        options: tcp::OPTIONS,
        build: TCP,
        by_itself: Some(ByItself { usable: ALWAYS, build: TCP }),
        opt_in: false,
    },
    BuiltIn {
        name: "auto",
        caps: Caps::NONE,
        options: &[],
        build: |o| Ok(Box::new(auto::AutoBackend::new(o)?)),
        by_itself: None,
        opt_in: false,
    },
    // The name PyTorch knows symmem by (its transport entry point): `auto` underneath, so a
    // Rust process and a PyTorch process pairing through `new_transport_rank("symmem")` meet
    // under the same store keys and speak the same URLs.
    BuiltIn {
        name: "symmem",
        caps: Caps::NONE,
        options: &[],
        build: |o| Ok(Box::new(auto::AutoBackend::named("symmem", o)?)),
        by_itself: None,
        opt_in: false,
    },
];

/// The members `auto` composes, each with how to build it, in its order of preference:
/// same-host backends first (they are the specialists), then the others in [`BUILT_IN`]'s
/// order.
///
/// A backend opted into by `SYMMEM_XHOST_BACKEND` (`ucx`) goes first among the network
/// members, built as its name asks (on whatever `UCX_TLS` allows).
pub(crate) fn auto_members() -> impl Iterator<Item = (&'static BuiltIn, Build)> {
    let opted = crate::config::xhost_backend();
    let chosen = move |b: &BuiltIn| b.opt_in && opted.as_deref() == Some(b.name);
    let same = BUILT_IN.iter().filter_map(|b| match &b.by_itself {
        Some(x) if b.caps.reach == Reach::SameHost => Some((b, x.build)),
        _ => None,
    });
    let opted_in = BUILT_IN.iter().filter({
        let chosen = chosen.clone();
        move |b| chosen(b)
    });
    let opted_in = opted_in.map(|b| (b, b.build));
    let rest = BUILT_IN.iter().filter_map(move |b| match &b.by_itself {
        Some(x) if b.caps.reach != Reach::SameHost && !chosen(b) => Some((b, x.build)),
        _ => None,
    });
    same.chain(opted_in).chain(rest)
}

/// The first built-in backend, in [`BUILT_IN`]'s order, that symmem may pick by itself here
/// and whose declared capabilities satisfy `need`: how symmetric memory chooses its links to
/// other hosts.
pub(crate) fn pick(need: impl Fn(&Caps) -> bool) -> Option<&'static str> {
    BUILT_IN
        .iter()
        .find(|b| b.by_itself.as_ref().is_some_and(|x| (x.usable)().is_ok()) && need(&b.caps))
        .map(|b| b.name)
}

/// The declared capabilities of the built-in backend `name`.
pub(crate) fn caps_of(name: &str) -> Option<Caps> {
    BUILT_IN.iter().find(|b| b.name == name).map(|b| b.caps)
}

fn registry() -> &'static Mutex<BTreeMap<String, Factory>> {
    static R: OnceLock<Mutex<BTreeMap<String, Factory>>> = OnceLock::new();
    R.get_or_init(|| {
        let built_in = BUILT_IN.iter().map(|b| {
            let build = b.build;
            (b.name.to_string(), Arc::new(move |o: &Options| build(o)) as Factory)
        });
        Mutex::new(built_in.collect())
    })
}

/// The factory registered under `name` (lower case).
pub(crate) fn factory(name: &str) -> Option<Factory> {
    registry().lock().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
}

/// Registers a backend factory under `name` (case-insensitive) for this process.
pub fn register_transport(name: &str, factory: Factory, replace: bool) -> Result<()> {
    let name = name.to_ascii_lowercase();
    if name.is_empty() {
        return Err(Error::InvalidArgument("transport name cannot be empty".into()));
    }
    let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
    if r.contains_key(&name) && !replace {
        return Err(Error::InvalidArgument(format!("transport {name:?} is already registered")));
    }
    r.insert(name, factory);
    Ok(())
}

/// The registered transport names, sorted.
pub fn available_transports() -> Vec<String> {
    registry().lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_backends_declare_what_their_instances_report() {
        for b in BUILT_IN.iter().filter(|b| b.by_itself.is_some()) {
            let backend = match (b.build)(&Options::new()) {
                Ok(backend) => backend,
                // ucx on a machine without UCX.
                Err(e @ Error::Unsupported { .. }) => {
                    eprintln!("SKIPPED: {}: {e}", b.name);
                    continue;
                }
                Err(e) => panic!("{}: {e}", b.name),
            };
            assert_eq!(backend.name(), b.name);
            assert_eq!(backend.caps(), b.caps, "{}", b.name);
            backend.shutdown();
        }
    }

    #[test]
    fn auto_prefers_same_host_members_and_links_need_atomics() {
        let order: Vec<_> = auto_members().map(|(b, _)| b.name).collect();
        assert_eq!(order, ["shm", "ucx", "tcp"]);
        // ucx only where UCX reaches other hosts without its tcp transport (not on a machine
        // without an RDMA fabric).
        let network = if ucx::fabric().is_ok() { "ucx" } else { "tcp" };
        assert_eq!(pick(|c| c.remote_atomics && c.reach == Reach::AnyHost), Some(network));
        assert_eq!(pick(|c| c.remote_atomics && c.reach == Reach::SameHost), None);
    }

    #[test]
    fn a_backend_without_remote_atomics_refuses_them_before_submitting() {
        use crate::tensor::{DType, Tensor};
        let (a, b) = (
            super::super::new_transport("shm", None, &Options::new()).unwrap(),
            super::super::new_transport("shm", None, &Options::new()).unwrap(),
        );
        let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
        a.connect(&ub, None).unwrap();
        b.connect(&ua, None).unwrap();
        let (x, y) = (Tensor::zeros(&[4], DType::U8).unwrap(), Tensor::zeros(&[4], DType::U8).unwrap());
        let mine = a.register_memory(&x).unwrap();
        let theirs = b.register_memory(&y).unwrap().to_remote_buffer().unwrap();
        let view = mine.to_view(0, None).unwrap();
        let err = a.start_atomic(&view, &theirs, super::super::Atomic::SlotPut, 1, None, false).unwrap_err();
        assert_eq!(err.transfer_kind(), Some(crate::error::TransferKind::Unsupported), "{err}");
        assert!(err.to_string().contains("no remote atomics"), "{err}");
    }
}
