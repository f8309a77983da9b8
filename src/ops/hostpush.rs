//! The machinery of the host-push algorithms (`all_reduce/host_push.rs`,
//! `all_to_all/host_push.rs`, `all_gather/host_push.rs`): small and medium collectives across
//! hosts, one one-way message from each rank to each other host, received by that host's
//! leader (its lowest rank).
//!
//! ```text
//!   per group and operator, a symmetric workspace: [ epoch words | buffers, twice ]
//!   all-reduce, call e (parity p = e % 2), n bytes:
//!     every rank   copies its input into slot `rank` of inbox p (its own buffer); writes it
//!                  into slot `rank` of every other host's leader's inbox p and raises that
//!                  leader's FROM[rank] word to e (a write and a remote atomic on one flow, so
//!                  in order, not awaited); tells its own leader (ARRIVE)
//!     each leader  waits for its host (ARRIVE) and every remote rank (FROM); reduces slots
//!                  0..ws in rank order (its host's ranks read in their own buffers) into
//!                  result p; releases its host (RELEASE)
//!     the others   copy the leader's result p
//!   from 64 KiB (DIRECT_MIN) a rank's input leaves straight from its symmetric tensor instead
//!   of its slot, its leader reads it there, and a host of one rank reduces into its tensor
//!   all-to-all: the same, with each rank sending the blocks for another host's ranks, and
//!   every rank copying its blocks from its host's ranks' inputs (their stages when small)
//!   and its leader's inbox, and returning once its host's ranks copied from its input
//!   all-gather (and reduce-scatter and -offset, one-shot, all-to-all-nd): the all-reduce's
//!   exchange without the leader's reduction (inputs through the slots, except contiguous
//!   ones from 64 KiB, 128 KiB on hosts of several ranks), every rank copying (or reducing)
//!   its host's ranks' slots (or inputs, then returning once they copied from its own) and
//!   its leader's inbox (the reduce-scatter's, the n-d all-to-all's and the fused
//!   matmul-reduce-scatter's along rows send each other host only its ranks' slices,
//!   `Travels::Range`); the broadcast's moves the root's input alone (and every rank's
//!   signature)
//!   tiny messages (up to 16 KiB per rank): the leader gathers its host's data first and sends
//!   one message per other host (FROM words then count leaders, not ranks; a FROM word is
//!   raised by its own rank, so it never overtakes that rank's data on another link, except
//!   by a leader whose ranks disagree: it raises those of its ranks that sent nothing, so a
//!   leader waiting for them finds the disagreement too, see `raise_for_gathered`; such a
//!   rank first makes sure its own raises of earlier calls landed, see `land_own_raises`)
//!   a call that needs a larger workspace: first a vote, a call of signatures only on the
//!   workspace the ranks have; if they agree they all need the same size and grow it together
//!   a call of the operator above host push's limit (another algorithm): the same vote, without
//!   growing, as its entry (`meet`), so a rank that passed a smaller size meets it
//! ```
//!
//! Buffers alternate, so nothing is overwritten while still read: a rank writes a leader's
//! inbox p of call e+2 only after it finished call e+1, which needed (through its own leader)
//! the FROM words of call e+1 of every rank of that leader's host, which they raise only after
//! they finished call e, reads of the inbox included. A rank's own slot is rewritten only
//! after the sends of call e-2 from it have landed. The reduction is the same kernel in the
//! same rank order as on one host, so the results are bitwise the same.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::group::Group;
pub(crate) use crate::symm::hostsync::runs;
use crate::symm::hostsync::{Sent, Words, settle};
use crate::symm::{self, Device, SymmHandle};
use crate::tensor::{DType, Tensor};
use crate::transport::Work;

/// The largest block of a host's inputs this path takes over tcp links (above, the two-shot
/// algorithm spreads the work over every rank).
pub(crate) const HOST_BLOCK_MAX: usize = 1 << 20;

/// The same over ucx links, whose messages above UCX's eager limit go by rendezvous (a request,
/// then the owner fetching the bytes): there the leader's one large message per host loses to
/// two-shot's spread sooner.
pub(crate) const UCX_HOST_BLOCK_MAX: usize = 512 << 10;

/// The same over ucx links for hosts of one rank, whose leader receives no more than each
/// rank sends, and reduces alone (2 ranks on 2 played hosts, `UCX_TLS=tcp`, alternated runs of
/// host push and two-shot: host push took 0.70x two-shot's time at 640 KiB, 0.81x at 768 KiB,
/// 0.91x at 896 KiB, 0.95-1.01x at 1 MiB, a tie, and 1.24x at 1.5 MiB).
pub(crate) const UCX_LONE_RANK_MAX: usize = 1 << 20;

/// The largest block of a host's inputs host push takes over links of `backend`
/// ([`crate::symm::SymmHandle::link_backend`]) with at most `ranks_per_host` ranks on a host.
pub(crate) fn host_block_max(backend: Option<&str>, ranks_per_host: usize) -> usize {
    match backend {
        Some("ucx") if ranks_per_host == 1 => UCX_LONE_RANK_MAX,
        Some("ucx") => UCX_HOST_BLOCK_MAX,
        _ => HOST_BLOCK_MAX,
    }
}

pub(crate) struct Workspace {
    pub(crate) _tensor: Tensor,
    pub(crate) words: Words,
    /// The operator whose calls use it (`"all_reduce"`, ...).
    pub(crate) kind: &'static str,
    /// Bytes per message this workspace holds (per rank).
    pub(crate) cap: usize,
    pub(crate) epoch: u32,
    pub(crate) sent: Sent,
    /// The epoch of this rank's last own FROM word ([`send_own_sig`]) not known to have landed
    /// (a posted write's Work completes once sent): see [`land_own_raises`].
    pub(crate) raised: Option<u32>,
    /// The last call, if its gathered messages went by Bruck's rounds ([`bruck`]): a verdict
    /// other than 0 then takes [`judge_after_bruck`].
    bruck: Option<Bruck>,
}

/// A call whose gathered messages a leader exchanged by Bruck's rounds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Bruck {
    call: u32,
    /// Whether the rounds all ended (else a partner took another way: the ranks disagree, and
    /// this leader's blocks are not all of the call).
    ended: bool,
}

impl Workspace {
    /// Whether call `e`'s gathered messages went by Bruck's rounds on this leader, and if so
    /// whether the rounds all ended.
    pub(crate) fn bruck_of(&self, e: u32) -> Option<bool> {
        self.bruck.filter(|b| b.call == e).map(|b| b.ended)
    }
}

/// Bytes of epoch words at the start of the workspace: ARRIVE[r] = r, RELEASE = ws,
/// FROM[r] = ws + 1 + r, and a leader's second FROM word at 2·ws + 1 + r ([`from2`]: raised by
/// Bruck's rounds in gathered calls, [`bruck`], and for the scattered all-reduce's reduced
/// slice, `all_reduce/host_push.rs`).
pub(crate) fn words_bytes(ws: usize) -> usize {
    (4 * (3 * ws + 1)).div_ceil(128) * 128
}

/// Bytes, after the words, of what every rank passed to the call of each parity (two words,
/// `check::counts`) and each parity's verdict (a word: 0, or 1 + the first rank that disagrees
/// with rank 0), before the buffers. Each rank sends its two words with its data; a leader has
/// every rank's (its host's in their own workspaces, the others' in its own) and so does every
/// other leader: all reach the same verdict, and hand it to their hosts with RELEASE.
pub(crate) fn sigs_bytes(ws: usize) -> usize {
    (2 * ws * 16 + 16).div_ceil(128) * 128
}

/// Where what rank `r` passed to the call of `parity` is, and that parity's verdict: byte
/// offsets in a workspace whose words start at `words`.
pub(crate) struct Sigs {
    pub(crate) at: usize,
    pub(crate) world: usize,
    pub(crate) parity: usize,
}

impl Sigs {
    pub(crate) fn new(words: usize, world: usize, parity: usize) -> Sigs {
        Sigs { at: words + words_bytes(world), world, parity }
    }

    pub(crate) fn slot(&self, r: usize) -> usize {
        self.at + (self.parity * self.world + r) * 16
    }

    pub(crate) fn verdict(&self) -> usize {
        self.at + 2 * self.world * 16 + self.parity * 8
    }
}

/// The 8-byte word at byte `at` of `rank`'s workspace (mapped on this host, or for this rank,
/// its own).
pub(crate) fn word(h: &SymmHandle, rank: usize, at: usize) -> &AtomicU64 {
    // `rank` is this rank or one on its host (callers read leaders and local ranks only), so
    // this is its mapping; remote writes land before the FROM word that publishes them.
    h.word64(rank, at)
}

pub(crate) fn read_sig(h: &SymmHandle, rank: usize, at: usize) -> [u64; 2] {
    // Relaxed: ordered by the Acquire loads of the epoch words that published them.
    [word(h, rank, at).load(Ordering::Relaxed), word(h, rank, at + 8).load(Ordering::Relaxed)]
}

/// Every rank's signature for this call, as the host's leader holds them: a local rank's in its
/// own workspace, a remote one's in the leader's.
pub(crate) fn verdict_of(h: &SymmHandle, leader: usize, sigs: &Sigs) -> u64 {
    let of = |r: usize| read_sig(h, if h.is_local(r) { r } else { leader }, sigs.slot(r));
    let first = of(0);
    (1..sigs.world).find(|&r| of(r) != first).map_or(0, |r| r as u64 + 1)
}

#[cold]
pub(crate) fn verdict_error(op: &str, h: &SymmHandle, leader: usize, sigs: &Sigs, verdict: u64) -> crate::error::Error {
    let r = (verdict - 1) as usize;
    let of = |r: usize| read_sig(h, if h.is_local(r) { r } else { leader }, sigs.slot(r));
    super::check::counts_disagree(op, of(0), r, of(r))
}

/// The rest of a host-push exchange of call `e` once this rank's data and signature are on
/// their way: a rank tells its leader (ARRIVE) and waits for its release; a leader waits for
/// its host's ranks, runs `arrived` (which may send on the host's behalf), waits for the FROM
/// words of `senders` (every remote rank, or the other hosts' leaders when they gather), judges
/// every rank's signature and releases its host (RELEASE). Returns the verdict every rank of
/// the group reads: 0, or 1 + the first rank whose signature differs from rank 0's.
pub(crate) fn exchange_and_judge(
    w: &mut Workspace,
    e: u32,
    sigs: &Sigs,
    senders: impl Iterator<Item = usize>,
    arrived: impl FnOnce(&mut Workspace) -> Result<()>,
    timeout: Duration,
) -> Result<u64> {
    let hw = w.words.h.clone();
    let (me, world) = (hw.rank(), hw.world_size());
    let p = hw.patience(timeout);
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let leader = locals[0];
    if me != leader {
        if left_to_leader(w.kind, read_sig(&hw, me, sigs.slot(me))) {
            land_own_raises(w, timeout)?;
        }
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
    } else {
        for &r in &locals[1..] {
            w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        }
        arrived(w)?;
        let split = host_split(&hw, sigs);
        if split {
            raise_for_gathered(w, e, sigs, timeout)?;
        }
        for r in senders {
            w.words.wait_for(from(r), e, r, &p, timeout)?;
        }
        // The same verdict on every leader (each has every signature), handed on with RELEASE.
        let bruck = w.bruck_of(e);
        let mut verdict = if bruck == Some(false) { u64::MAX } else { verdict_of(&hw, me, sigs) };
        if verdict != 0 && bruck.is_some() {
            verdict = judge_after_bruck(w, e, sigs, split, timeout)?;
        } else if verdict != 0 && !split {
            raise_for_gathered(w, e, sigs, timeout)?;
        }
        word(&hw, me, sigs.verdict()).store(verdict, Ordering::Relaxed);
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
    }
    w.epoch = e;
    // Relaxed: the leader stored it before RELEASE (or is this rank).
    Ok(word(&hw, leader, sigs.verdict()).load(Ordering::Relaxed))
}

/// A group's workspaces per operator, each locked for the length of a call; the map itself only
/// for a lookup. Kept in the group, so they go with it.
#[derive(Default)]
pub(crate) struct Workspaces(Mutex<Kinds>);

/// What a group keeps per operator kind (`"all_reduce"`, `"all_to_all"`, `"all_gather"`,
/// `"all_to_all_vdev"`).
#[derive(Default)]
pub(crate) struct Kinds {
    /// The workspace each kind's calls use now.
    made: HashMap<&'static str, Arc<Mutex<Workspace>>>,
    /// Operators whose ranks may be out of step, and why: refused from then on ([`guarded`]).
    out_of_step: HashMap<&'static str, String>,
    /// Workspaces outgrown, kept with the group: a rank's messages of the last call on one
    /// may still be on their way when its peers have moved to the next (in a vote, a rank's
    /// own signature and FROM word travel on its own link while its leader's, which the other
    /// leaders wait for, travel on the leader's), and must find the memory they were sent to
    /// still exposed; a refused posted write would end the link.
    retired: Vec<Arc<Mutex<Workspace>>>,
}

/// Runs one call of operator `kind` across hosts on `group` (`call`, whichever algorithm it
/// takes; for the host-push ones, `kind` names their workspace). A call that fails part-way
/// (a wait that timed out, a transfer that failed, a workspace not made) may have left its
/// ranks at different points of the protocol: one waiting in a collective allocation that the
/// others never entered, one that sent its data and signal for a call its peer never ran.
/// Their call numbers and buffers then disagree, and a later call could take data left from
/// the failed one as its own. So from then on
/// every call of the kind on the group is refused at once, naming the failure; the group's
/// other operators, and other groups, go on. A disagreement found by the signatures
/// (`InvalidArgument`) ends the call on every rank at the same point, and changes nothing.
pub(crate) fn guarded<T>(group: &Group, kind: &'static str, call: impl FnOnce() -> Result<T>) -> Result<T> {
    let state = group.state::<Workspaces>();
    if let Some(why) = lock(&state.0).out_of_step.get(kind) {
        return Err(Error::Rendezvous(format!(
            "{kind} across hosts on group {:?} is out of step: an earlier call failed part-way ({why}); its ranks may \
             have left that call at different points, and a later call could take another call's data, so every \
             later call is refused. Make a new group (Group::split) to go on",
            group.name()
        )));
    }
    let r = call().map_err(|e| {
        // A lost peer: told to the group (`Words::sound`), so that ranks waiting for others
        // that wait in vain fail too, at once.
        let w = lock(&state.0).made.get(kind).cloned();
        match w {
            Some(w) => lock(&w).words.report(e),
            None => e,
        }
    });
    if let Err(e) = &r
        && !matches!(e, Error::InvalidArgument(_))
    {
        lock(&state.0).out_of_step.entry(kind).or_insert_with(|| e.to_string());
    }
    r
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A workspace's first size (bytes per message), whatever the call that makes it: every rank
/// makes it at the same call, the kind's first, and so at the same size whatever sizes they
/// pass. Larger calls grow it after a vote ([`vote`]).
const FIRST_CAP: usize = 4096;

/// The workspace of `kind` on `group` for messages of up to `cap` bytes, `bytes(cap)` after
/// the words; made collectively at the kind's first call, at [`FIRST_CAP`]. A call that needs
/// more first has the ranks vote with their signatures (`sig`) on the workspace they have:
/// ranks that pass the same arguments all need the same size, and grow it together; ranks that
/// disagree all get the same error from `disagree(rank 0's, first rank that differs, its)`,
/// instead of one rank waiting in the growth's allocation while the others wait for its data.
pub(crate) fn workspace(
    group: &Group,
    kind: &'static str,
    cap: usize,
    bytes: impl Fn(usize) -> usize,
    sig: [u64; 2],
    disagree: impl Fn([u64; 2], usize, [u64; 2]) -> Error,
    timeout: Duration,
) -> Result<Arc<Mutex<Workspace>>> {
    let state = group.state::<Workspaces>();
    let mut all = lock(&state.0);
    let w = match all.made.get(kind) {
        Some(w) => w.clone(),
        None => {
            let w = make(group, kind, FIRST_CAP, &bytes, timeout)?;
            all.made.insert(kind, w.clone());
            w
        }
    };
    if lock(&w).cap >= cap {
        return Ok(w);
    }
    vote(&mut lock(&w), sig, disagree, timeout)?;
    // Every rank voted for this size: they grow together.
    let w = make(group, kind, cap, &bytes, timeout)?;
    if let Some(old) = all.made.insert(kind, w.clone()) {
        all.retired.push(old);
    }
    Ok(w)
}

/// The entry of a call of `kind` across hosts that takes another algorithm than host push
/// (sizes above its limit), in place of the checked entry's barrier: one exchange of
/// signatures on the kind's workspace (made as [`workspace`] makes it, `bytes` its layout),
/// which is a barrier across the group and hands every rank the same verdict. A rank that
/// passed a size on host push's side of the limit runs a host-push call (or its vote) on the
/// same workspace meanwhile, to which this exchange looks like a call of its own (see
/// [`vote`]): instead of each waiting for the other's protocol until the timeout, both find
/// that their signatures disagree (`sig` is [`crate::ops::check::counts_stamped`], never a
/// host-push call's), at once, and the operator goes on working on the group.
pub(crate) fn meet(
    group: &Group,
    kind: &'static str,
    bytes: impl Fn(usize) -> usize,
    sig: [u64; 2],
    disagree: impl Fn([u64; 2], usize, [u64; 2]) -> Error,
    timeout: Duration,
) -> Result<()> {
    let w = workspace(group, kind, 0, bytes, sig, &disagree, timeout)?;
    let mut guard = lock(&w);
    vote(&mut guard, sig, disagree, timeout)
}

/// A new workspace for messages of up to `cap` bytes (rounded up), made collectively.
fn make(
    group: &Group,
    kind: &'static str,
    cap: usize,
    bytes: impl Fn(usize) -> usize,
    timeout: Duration,
) -> Result<Arc<Mutex<Workspace>>> {
    let cap = cap.max(FIRST_CAP).next_power_of_two();
    let world = group.world_size();
    let t = symm::empty(&[words_bytes(world) + sigs_bytes(world) + bytes(cap)], DType::U8, Device::Cpu)?;
    let handle = symm::rendezvous(&t, group)?;
    handle.barrier(0, timeout)?;
    let words = Words::new(handle, 0);
    Ok(Arc::new(Mutex::new(Workspace {
        _tensor: t,
        words,
        kind,
        cap,
        epoch: 0,
        sent: Vec::new(),
        raised: None,
        bruck: None,
    })))
}

/// A call of the workspace's protocol that carries only the signatures: what a rank whose call
/// needs a larger workspace runs instead of its call, on the workspace it has. To every other
/// rank it looks like a call of either mode (a rank's signature and FROM word go to every
/// other host's leader, as when it sends its own; a leader also forwards its host's
/// signatures, as when it gathers), and a leader waits for the other leaders, each of which
/// forwarded its host's signatures before its FROM word: with every rank voting, every leader
/// has every signature. A rank in a call of the usual kind ends it with them: they disagree.
fn vote(
    w: &mut Workspace,
    sig: [u64; 2],
    disagree: impl Fn([u64; 2], usize, [u64; 2]) -> Error,
    timeout: Duration,
) -> Result<()> {
    let hw = w.words.h.clone();
    let (me, world) = (hw.rank(), hw.world_size());
    let e = w.epoch.wrapping_add(1);
    let sigs = Sigs::new(hw.offset(), world, (e % 2) as usize);
    let leader = hw.local_ranks()[0];
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    for (i, v) in sig.into_iter().enumerate() {
        // Relaxed: published by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    if me != leader {
        for l in hw.leaders().filter(|&l| l != leader) {
            hw.batch(l, || send_own_sig(w, l, e, &sigs, timeout))?;
        }
    }
    let remote: Vec<usize> = hw.leaders().filter(|&l| l != leader).collect();
    let forward = |w: &mut Workspace| -> Result<()> {
        gather_sigs(&hw, &sigs);
        for l in hw.leaders().filter(|&l| l != leader) {
            hw.batch(l, || send_host_sigs(w, l, e, &sigs, timeout))?;
        }
        Ok(())
    };
    let verdict = exchange_and_judge(w, e, &sigs, remote.into_iter(), forward, timeout)?;
    if verdict != 0 {
        let r = (verdict - 1) as usize;
        let of = |r: usize| read_sig(&hw, if hw.is_local(r) { r } else { leader }, sigs.slot(r));
        return Err(disagree(of(0), r, of(r)));
    }
    Ok(())
}

/// On a leader: copies its host's other ranks' signatures into its own workspace's slots.
pub(crate) fn gather_sigs(hw: &SymmHandle, sigs: &Sigs) {
    let me = hw.rank();
    for &r in &hw.local_ranks()[1..] {
        for (i, v) in read_sig(hw, r, sigs.slot(r)).into_iter().enumerate() {
            // Relaxed: r's slot was published by its ARRIVE (seen with Acquire); these go out
            // before the FROM words that publish them.
            word(hw, me, sigs.slot(r) + 8 * i).store(v, Ordering::Relaxed);
        }
    }
}

/// On a leader whose host's ranks all arrived in call `e` of an exchange its leader gathers
/// (messages of `n` bytes up to [`GATHERED_MAX`], each rank's in its slot at `slot(rank)`,
/// `stride` bytes apart): copies their slots into its own and sends its host's, as runs of
/// consecutive ranks, with their signatures and then its FROM word, to every other leader.
/// `travels: Some(root)`: only rank `root`'s slot travels (if it is of this host), and the
/// signatures.
#[allow(clippy::too_many_arguments, reason = "the exchange's call")]
pub(crate) fn send_gathered(
    w: &mut Workspace,
    e: u32,
    sigs: &Sigs,
    slot: impl Fn(usize) -> usize,
    stride: usize,
    n: usize,
    travels: Option<usize>,
    timeout: Duration,
) -> Result<()> {
    let hw = w.words.h.clone();
    let all = hw.local_ranks();
    let only: Vec<usize>;
    let locals = match travels {
        None => all,
        Some(root) => {
            only = all.iter().copied().filter(|&r| r == root).collect();
            &only
        }
    };
    let me = hw.rank();
    for &r in locals.iter().filter(|&&r| r != me) {
        // SAFETY: rank r's slot is final (its ARRIVE e seen with Acquire) and r rewrites it only
        // for call e+2, after this leader's RELEASE e+1; this leader's copy of it is sent from,
        // and rewritten only after the sends of call e-2 landed (the caller settled them).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (hw.read_ptr(r) + slot(r)) as *const u8,
                (hw.read_ptr(me) + slot(r)) as *mut u8,
                n,
            )
        };
    }
    gather_sigs(&hw, sigs);
    if by_bruck(&hw, travels) {
        // Marked before the rounds: a round that fails leaves the call on this leader anyway.
        w.bruck = Some(Bruck { call: e, ended: false });
        let ended = bruck(w, e, sigs, &slot, stride, n, timeout)?;
        w.bruck = Some(Bruck { call: e, ended });
        return Ok(());
    }
    w.bruck = None;
    for l in hw.leaders().filter(|&l| l != me) {
        // The host's data, their signatures and the FROM word leave together.
        hw.batch(l, || -> Result<()> {
            send_slots(w, l, e, locals, &slot, stride, n, timeout)?;
            send_host_sigs(w, l, e, sigs, timeout)
        })?;
    }
    Ok(())
}

/// Inside a batch to leader `to` in call `e`: the `n`-byte slots (at `slot(rank)`, `stride`
/// bytes apart) of `ranks` (ascending), each run of consecutive ranks as one message, in
/// pieces the link keeps in order with a word started after them.
#[allow(clippy::too_many_arguments, reason = "send_gathered's and bruck's call")]
fn send_slots(
    w: &mut Workspace,
    to: usize,
    e: u32,
    ranks: &[usize],
    slot: impl Fn(usize) -> usize,
    stride: usize,
    n: usize,
    timeout: Duration,
) -> Result<()> {
    let hw = w.words.h.clone();
    for (a, b) in runs(ranks) {
        let (first, len) = (ranks[a], (b - a - 1) * stride + n);
        for work in send_before_signal(&hw, to, slot(first), slot(first), len, timeout)? {
            w.sent.push((to, e, work));
        }
    }
    Ok(())
}

/// From this many hosts on, leaders that gather their hosts' messages exchange them by Bruck's
/// all-gather ([`bruck`]): ⌈log2 H⌉ rounds of one message each instead of one round of H − 1.
pub(crate) const BRUCK_FROM: usize = 4;

/// Whether this call's gathered messages (`travels`: see [`send_gathered`]) go by Bruck's
/// rounds: every block to every leader, from [`BRUCK_FROM`] hosts on. Its leader then waits
/// for no sender after them (the rounds did).
pub(crate) fn by_bruck(hw: &SymmHandle, travels: Option<usize>) -> bool {
    travels.is_none() && hw.hosts() >= BRUCK_FROM
}

/// On a leader, once its host's slots and signatures are in its own workspace: Bruck's
/// all-gather of the hosts' blocks among the leaders (Bruck, Ho, Kipnis, Upfal and Weathersby,
/// 1997), hosts numbered in leader order. In round k (`d` = 2^k < H) leader j sends the blocks
/// it holds, those of hosts j .. j + min(d, H − d) − 1 (wrapping; its ranks' slots and
/// signatures, as runs of consecutive ranks, then its second FROM word, [`from2`]) to leader
/// j − d, and waits for the second FROM word of leader j + d, whose blocks then landed in its
/// own workspace: after the last round it holds every host's. Each round's sender is a
/// different leader (its distance differs), so its word tells the round. Only Bruck's rounds
/// raise a leader's second word in a gathered call (the scattered all-reduce's, the other use,
/// only once its ranks agreed on a call of another size).
///
/// Every block of call e that a leader forwards landed before the word it waited for; a
/// leader holding every block of call e+1 has heard, through the rounds, from every leader that
/// began call e+1 (so finished reading call e's parity, which e+2 rewrites). So by induction
/// every block a leader forwards is of call e, from a leader in these rounds.
///
/// A leader whose ranks' call takes another way (a rank sending its own, a vote) raises its
/// (first) FROM word on every leader, and so does a leader of these rounds that found the ranks
/// disagree ([`judge_after_bruck`]): a leader that finds its round's partner's first word at
/// the call instead of its second stops the rounds (the ranks disagree, and that partner
/// forwards nothing) and returns `false`, for judging; every leader waiting on it stops too,
/// once it raised its own. Otherwise true.
#[allow(clippy::too_many_arguments, reason = "send_gathered's call")]
fn bruck(
    w: &mut Workspace,
    e: u32,
    sigs: &Sigs,
    slot: impl Fn(usize) -> usize,
    stride: usize,
    n: usize,
    timeout: Duration,
) -> Result<bool> {
    let hw = w.words.h.clone();
    let (me, world) = (hw.rank(), hw.world_size());
    let leaders: Vec<usize> = hw.leaders().collect();
    let hosts = leaders.len();
    let j = hw.host_of(me);
    let p = hw.patience(timeout);
    for round in 0..crate::symm::hostsync::rounds(hosts) {
        let d = 1 << round;
        let (to, from) = (leaders[(j + hosts - d) % hosts], leaders[(j + d) % hosts]);
        let mut ranks: Vec<usize> =
            (0..d.min(hosts - d)).flat_map(|i| hw.ranks_on((j + i) % hosts).iter().copied()).collect();
        ranks.sort_unstable();
        hw.batch(to, || -> Result<()> {
            send_slots(w, to, e, &ranks, &slot, stride, n, timeout)?;
            for (a, b) in runs(&ranks) {
                // In pieces the link keeps in order with the word that follows.
                let at = sigs.slot(ranks[a]);
                for work in send_before_signal(&hw, to, at, at, (b - a) * 16, timeout)? {
                    w.sent.push((to, e, work));
                }
            }
            w.sent.push((to, e, w.words.start_remote(to, from2(world, me), e, timeout)?));
            Ok(())
        })?;
        if !w.words.wait_for_either(from2(world, from), world + 1 + from, e, from, &p, timeout)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The index of rank `r`'s second FROM word in a workspace of `world` ranks (see
/// [`words_bytes`]).
pub(crate) fn from2(world: usize, r: usize) -> usize {
    2 * world + 1 + r
}

/// On a leader whose Bruck exchange of call `e` ([`bruck`]) found the signatures disagree, or
/// a partner that took another way: the one-round protocol's ending, so that every leader
/// reaches the same verdict from every rank's signature of this call (each landed before the
/// word waited for here, and whatever Bruck forwarded is of this call too), and no leader of
/// another mode waits in vain. It sends its
/// host's signatures and its FROM word to every other leader (a leader whose ranks send their
/// own waits for every rank's word), raises those of its ranks that left their messages to it
/// ([`raise_for_gathered`]; `raised`: it did already, its host being split), and waits for the
/// FROM word of every rank on another host (each
/// raised after its signature, by itself or by its leader, every leader of this mode doing the
/// same); returns the verdict from those signatures.
pub(crate) fn judge_after_bruck(
    w: &mut Workspace,
    e: u32,
    sigs: &Sigs,
    raised: bool,
    timeout: Duration,
) -> Result<u64> {
    let hw = w.words.h.clone();
    let (me, world) = (hw.rank(), hw.world_size());
    let p = hw.patience(timeout);
    gather_sigs(&hw, sigs);
    for l in hw.leaders().filter(|&l| l != me) {
        hw.batch(l, || send_host_sigs(w, l, e, sigs, timeout))?;
    }
    if !raised {
        raise_for_gathered(w, e, sigs, timeout)?;
    }
    for r in (0..world).filter(|&r| !hw.is_local(r)) {
        w.words.wait_for(world + 1 + r, e, r, &p, timeout)?;
    }
    Ok(verdict_of(&hw, me, sigs))
}

/// On a leader, inside a batch to leader `l` of another host: its host's signatures (gathered
/// by [`gather_sigs`]), then its own FROM word, which tells `l` they landed (the link keeps
/// them in order). A FROM word is only ever raised by its own rank, on its own link: a word
/// raised for a rank by another could overtake, on another link, that rank's message of the
/// same call, and a leader still waiting in that call would read its slot too soon.
pub(crate) fn send_host_sigs(w: &mut Workspace, l: usize, e: u32, sigs: &Sigs, timeout: Duration) -> Result<()> {
    let hw = w.words.h.clone();
    let locals = hw.local_ranks();
    for (a, end) in runs(locals) {
        let at = sigs.slot(locals[a]);
        w.sent.push((l, e, hw.start_push(l, at, (end - a) * 16, at, timeout)?));
    }
    w.sent.push((l, e, w.words.start_remote(l, hw.world_size() + 1 + hw.rank(), e, timeout)?));
    Ok(())
}

/// Inside a batch to leader `l` of another host, after this rank's data of call `e` (if any):
/// its signature, then its FROM word, which tells `l` both landed (the link keeps them in
/// order). The only place a rank raises a FROM word.
pub(crate) fn send_own_sig(w: &mut Workspace, l: usize, e: u32, sigs: &Sigs, timeout: Duration) -> Result<()> {
    let hw = w.words.h.clone();
    let me = hw.rank();
    w.sent.push((l, e, hw.start_push(l, sigs.slot(me), 16, sigs.slot(me), timeout)?));
    w.sent.push((l, e, w.words.start_remote(l, hw.world_size() + 1 + me, e, timeout)?));
    w.raised = Some(e);
    Ok(())
}

/// On a rank other than its host's leader, before it tells its leader it arrived in a call
/// whose messages it leaves to that leader (whose FROM word the leader may then raise on the
/// other leaders, [`raise_for_gathered`]): makes sure its own FROM words of earlier calls have
/// landed. Those travel on this rank's links, the leader's raise on the leader's: an older
/// one still on its way could land after the leader's, setting the word back (a leader would
/// then wait for this call's word until its timeout), or be overtaken by it (a leader still in
/// the earlier call would take the word for that call's and read this rank's data before it
/// landed). A posted write's Work completes once sent, so this raises the last one again,
/// answered, on each other leader (the same value: it changes nothing there); its answer comes
/// after every earlier request on the link ran. A round trip per other host, only in the first
/// such call after one in which this rank sent its own.
pub(crate) fn land_own_raises(w: &mut Workspace, timeout: Duration) -> Result<()> {
    let Some(e) = w.raised else { return Ok(()) };
    let hw = w.words.h.clone();
    let (me, leader) = (hw.rank(), hw.local_ranks()[0]);
    let mut raises = Named::new();
    for l in hw.leaders().filter(|&l| l != leader) {
        raises.push((l, w.words.start_remote_landed(l, hw.world_size() + 1 + me, e, timeout)?));
    }
    wait_named(&hw, &mut raises, "signalling", timeout)?;
    w.raised = None;
    Ok(())
}

/// Waits for `works` (emptying it), each a transfer `what` (`"writing to"`, `"signalling"`)
/// the rank it names: every one, even after a failure, so that none still reads a caller's
/// buffer once this returns, all within `timeout`; the first failure names its rank.
pub(crate) fn wait_named(hw: &SymmHandle, works: &mut Named, what: &str, timeout: Duration) -> Result<()> {
    let deadline = crate::sync::deadline(timeout);
    let mut first = None;
    for (rank, work) in works.drain(..) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if let Err(e) = work.wait(Some(left))
            && first.is_none()
        {
            first = Some(hw.failed(what, rank, e));
        }
    }
    first.map_or(Ok(()), Err)
}

/// Whether the signatures of this leader's host differ among themselves (a leader's look once
/// its host's ranks arrived).
pub(crate) fn host_split(hw: &SymmHandle, sigs: &Sigs) -> bool {
    let mine = read_sig(hw, hw.rank(), sigs.slot(hw.rank()));
    hw.local_ranks()[1..].iter().any(|&r| read_sig(hw, r, sigs.slot(r)) != mine)
}

/// Whether a rank whose signature in a call on a workspace of `kind` is `sig` left its messages
/// to its leader (a host-push call of up to [`GATHERED_MAX`] bytes of the all-reduce, the
/// all-to-all or the all-gather): it then raised no FROM word on any other host. A signature stamped with a
/// call's digest ([`crate::ops::check::counts_stamped`]), or of the all-to-all-v family, is of
/// a rank that sends its own.
fn left_to_leader(kind: &str, sig: [u64; 2]) -> bool {
    if kind == "all_to_all_vdev" || sig[1] >> 16 != 0 {
        return false;
    }
    DType::from_code(sig[1] as u8)
        .and_then(|d| usize::try_from(sig[0] & crate::ops::check::COUNT_BITS).ok()?.checked_mul(d.size()))
        .is_some_and(|n| n <= GATHERED_MAX)
}

/// A leader's part in a call of `e` whose ranks disagree (its host's signatures differ, or its
/// judgement found it), before it releases its host: where the ranks straddle the gathering
/// limit, a leader that sends its own data waits for the FROM word of every rank of the other
/// hosts, and a rank of this host that left its messages to this leader raised none. This
/// leader raises them for it, after its signature, on every other leader, and waits for them to
/// land: that leader then holds every signature, finds the disagreement too, and reads none of
/// the call's data (so no such word can overtake data of the rank's: it sent none). Landed
/// before the release, a word raised here is never later than the rank's own of its next call.
pub(crate) fn raise_for_gathered(w: &mut Workspace, e: u32, sigs: &Sigs, timeout: Duration) -> Result<()> {
    let hw = w.words.h.clone();
    let locals = hw.local_ranks();
    let quiet: Vec<usize> =
        locals[1..].iter().copied().filter(|&r| left_to_leader(w.kind, read_sig(&hw, r, sigs.slot(r)))).collect();
    if quiet.is_empty() {
        return Ok(());
    }
    gather_sigs(&hw, sigs);
    let mut raises = Named::new();
    for l in hw.leaders().filter(|&l| l != locals[0]) {
        hw.batch(l, || -> Result<()> {
            for &r in &quiet {
                w.sent.push((l, e, hw.start_push(l, sigs.slot(r), 16, sigs.slot(r), timeout)?));
                raises.push((l, w.words.start_remote_landed(l, hw.world_size() + 1 + r, e, timeout)?));
            }
            Ok(())
        })?;
    }
    wait_named(&hw, &mut raises, "signalling", timeout)
}

/// Writes `len` bytes at `src` of this rank's buffer to `dst` of `leader`'s, so that a remote
/// atomic started next lands after them; returns the writes still in flight.
pub(crate) fn send_before_signal(
    h: &SymmHandle,
    leader: usize,
    src: usize,
    dst: usize,
    len: usize,
    timeout: Duration,
) -> Result<Vec<Work>> {
    send_pieces_before_signal(h, leader, len, |at, n| h.start_push(leader, src + at, n, dst + at, timeout))
}

/// As [`send_before_signal`], each piece started by `push(at, len)` (a write of the `len` bytes
/// at `at` of the message): see `Link::write_before_signal`. A leader on this host needs no
/// signal ordering: its piece is written at once.
pub(crate) fn send_pieces_before_signal(
    h: &SymmHandle,
    leader: usize,
    len: usize,
    push: impl Fn(usize, usize) -> Result<Work>,
) -> Result<Vec<Work>> {
    match h.remote(leader) {
        Some(r) => r.link.write_before_signal(len, push).map_err(|e| r.link.error("writing to", &e)),
        None => {
            push(0, len)?.wait(None)?;
            Ok(Vec::new())
        }
    }
}

/// Transfers, each with the rank it goes to ([`wait_named`]).
pub(crate) type Named = Vec<(usize, Work)>;

/// [`send_pieces_before_signal`] of a message that leaves straight from a caller's tensor: its
/// writes join `writes`, waited for ([`landed`]) before the tensor is the caller's again.
pub(crate) fn send_from_tensor(
    h: &SymmHandle,
    leader: usize,
    len: usize,
    push: impl Fn(usize, usize) -> Result<Work>,
    writes: &mut Named,
) -> Result<()> {
    writes.extend(send_pieces_before_signal(h, leader, len, push)?.into_iter().map(|w| (leader, w)));
    Ok(())
}

/// Waits for the writes of [`send_from_tensor`] ([`wait_named`]).
pub(crate) fn landed(h: &SymmHandle, writes: &mut Named, timeout: Duration) -> Result<()> {
    wait_named(h, writes, "writing to", timeout)
}

/// Data for another host leaves straight from a symmetric input rather than through the
/// workspace from this many bytes (below, one copy into the workspace costs less than a second
/// message); the call then waits for those writes before returning, the input being the
/// caller's again.
pub(crate) const DIRECT_MIN: usize = 64 << 10;

/// On a host of several ranks, a rank's host's ranks copy what they take of its input straight
/// from its tensor (then wait for each other's COPIED words before returning, the inputs being
/// the callers' again after) rather than from a copy it made in its workspace, when each takes
/// this many bytes or more: below, the wait costs more than the copy it saves (4 ranks on 2
/// played hosts, paired runs of the two ways: reduce-scatter over ucx 1.13x the time at 64 KiB
/// per rank, all-to-all over ucx 1.55x at 128 KiB per rank, 32 KiB blocks; from 128 KiB taken,
/// 0.71-0.92x, all-gather, reduce-scatter and all-to-all, over tcp and ucx).
pub(crate) const SHARED_DIRECT_MIN: usize = 128 << 10;

/// The largest block of a host's inputs the scattered all-reduce (from
/// [`crate::ops::all_reduce::host_push::SCATTER_FROM`] hosts) takes over links of `backend`
/// among `hosts` hosts: 4 MiB over tcp (ucx keeps [`host_block_max`], not measured beyond two
/// hosts), and at most 32 MiB / hosts, so that the workspace (two slots per rank of the group,
/// each a rank's input rounded up to a power of two: at most 4·hosts·block bytes, and two
/// results) stays within about 128 MiB.
pub(crate) fn scattered_block_max(backend: Option<&str>, ranks_per_host: usize, hosts: usize) -> usize {
    let block = match backend {
        Some("ucx") => host_block_max(backend, ranks_per_host),
        _ => SCATTERED_BLOCK_MAX,
    };
    block.min(SCATTERED_WORKSPACE_MAX / 2 / hosts.max(1))
}

/// See [`scattered_block_max`].
const SCATTERED_BLOCK_MAX: usize = 4 << 20;
const SCATTERED_WORKSPACE_MAX: usize = 64 << 20;

/// Whether a message of `bytes` with at most `ranks_per_host` ranks on a host, over links of
/// `backend`, takes this path.
pub(crate) fn fits_size(bytes: usize, ranks_per_host: usize, backend: Option<&str>) -> bool {
    fits_host(bytes, ranks_per_host, host_block_max(backend, ranks_per_host))
}

/// Whether a message of `bytes` (each rank's input in a slot of 16-byte multiples) with at
/// most `ranks_per_host` ranks on a host keeps a host's inputs within `host_max` bytes.
pub(crate) fn fits_host(bytes: usize, ranks_per_host: usize, host_max: usize) -> bool {
    bytes > 0 && bytes.next_multiple_of(16).saturating_mul(ranks_per_host) <= host_max
}

/// Up to this many bytes per rank, a host's leader aggregates its host's sends (one message per
/// pair of hosts); above, every rank sends its own (no copies through the leader, every rank's
/// link busy). Both ways use the same workspace: FROM words count the sender's epochs either
/// way, and a leader is a rank.
pub(crate) const GATHERED_MAX: usize = 16 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::check::{Stamp, counts, counts_stamped};
    use crate::ops::reduce::ReduceOp;

    #[test]
    fn only_a_host_push_call_up_to_the_gathering_limit_leaves_its_messages_to_its_leader() {
        let sig = |n: usize, dtype: DType| counts(&Tensor::zeros(&[n], dtype).unwrap(), Some(ReduceOp::Sum));
        // 16 KiB of f32 or of bf16 are gathered; a byte more is not.
        assert!(left_to_leader("all_reduce", sig(4096, DType::F32)));
        assert!(left_to_leader("all_to_all", sig(8192, DType::BF16)));
        assert!(left_to_leader("all_gather", sig(4096, DType::F32)));
        assert!(!left_to_leader("all_gather", sig(4097, DType::F32)));
        // The view's offset travels in the count's upper bits: it changes nothing here.
        let at = |n: usize, offset: usize| {
            crate::ops::check::counts_at(&Tensor::zeros(&[n], DType::F32).unwrap(), None, offset)
        };
        assert!(left_to_leader("all_gather", at(4096, 1 << 20)));
        assert!(!left_to_leader("all_gather", at(4097, 16)));
        assert_ne!(at(4096, 0), at(4096, 16), "views at different offsets disagree");
        assert!(!left_to_leader("all_reduce", sig(4097, DType::F32)));
        assert!(!left_to_leader("all_reduce", sig(8192, DType::F32)));
        // The all-to-all-v family always sends its own; so does the entry of a large call.
        assert!(!left_to_leader("all_to_all_vdev", sig(4, DType::F32)));
        let t = Tensor::zeros(&[4], DType::F32).unwrap();
        let stamped = counts_stamped(&t, None, &Stamp::new("all_reduce", &t, 0, &[]));
        assert!(stamped[1] >> 16 != 0);
        assert!(!left_to_leader("all_reduce", stamped));
        // A count whose bytes overflow, or an unknown dtype code, is not a gathered call.
        assert!(!left_to_leader("all_reduce", [u64::MAX, u64::from(DType::F32.code())]));
        assert!(!left_to_leader("all_reduce", [4, 0xff]));
    }
}
