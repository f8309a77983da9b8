//! What the serving backends' tests share (`tcp`, `ucx`): connecting a pair, and the checks of
//! batches and posted requests every such backend must pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{Atomic, Options, Transport, new_transport};
use crate::tensor::{DType, Tensor};

pub(crate) const LONG: Option<Duration> = Some(Duration::from_secs(30));

/// Connects `a` and `b` to each other.
pub(crate) fn connect(a: Transport, b: Transport) -> (Transport, Transport) {
    let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
    a.connect(&ub, None).unwrap();
    b.connect(&ua, None).unwrap();
    (a, b)
}

/// Two connected endpoints of `backend`, or `None` (saying SKIPPED) where it cannot run.
pub(crate) fn pair(backend: &str) -> Option<(Transport, Transport)> {
    match (new_transport(backend, None, &Options::new()), new_transport(backend, None, &Options::new())) {
        (Ok(a), Ok(b)) => Some(connect(a, b)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

pub(crate) fn u32_at(t: &Tensor, at: usize) -> u32 {
    let v = t.to_vec::<u8>().unwrap();
    u32::from_le_bytes(v[at..at + 4].try_into().unwrap())
}

/// Small requests started in a batch are held until it ends (or a waiter sends them); then
/// writes, reads (in order: they see the writes before them), stores and refused requests in
/// the middle each get their own outcome, with a write and a read larger than a batch takes.
pub(crate) fn a_batch_of_mixed_requests_each_get_their_own_outcome(a: &Transport, b: &Transport) {
    let big = 20 * 1024;
    let dst = Tensor::zeros(&[4096 + big], DType::U8).unwrap();
    let remote = b.register_memory(&dst).unwrap().to_remote_buffer().unwrap();
    // Withdrawn after its descriptor was handed out: only the target can refuse it.
    let gone = Tensor::zeros(&[64], DType::U8).unwrap();
    let withdrawn = b.register_memory(&gone).unwrap();
    let stale = withdrawn.to_remote_buffer().unwrap();
    b.unregister_memory(&withdrawn).unwrap();
    let src: Vec<u8> = (0..4096 + big).map(|i| (i * 7 + 1) as u8).collect();
    let src = Tensor::from_slice(&[src.len()], &src).unwrap();
    let ms = a.register_memory(&src).unwrap();
    let back = Tensor::zeros(&[4096 + big], DType::U8).unwrap();
    let mb = a.register_memory(&back).unwrap();
    let word = Tensor::zeros(&[8], DType::U8).unwrap();
    let mw = a.register_memory_read_only(&word).unwrap();
    let (ok, refused) = a
        .batch(|| -> crate::error::Result<_> {
            let (mut ok, mut refused) = (Vec::new(), Vec::new());
            for i in 0..64 {
                let at = i * 64;
                ok.push(a.start_write(&ms.to_view(at, Some(60))?, &remote.slice(at as u64, 60)?, LONG)?);
                if i % 16 == 5 {
                    // Refused mid-batch: what follows is served all the same.
                    refused.push(a.start_write(&ms.to_view(0, Some(48))?, &stale.slice(0, 48)?, LONG)?);
                }
                ok.push(a.start_read(&mb.to_mutable_view(at, Some(60))?, &remote.slice(at as u64, 60)?, LONG)?);
                let word_at = remote.slice((at + 60) as u64, 4)?;
                let posted = i % 2 == 0;
                ok.push(a.start_atomic(&mw.to_view(0, Some(4))?, &word_at, Atomic::Set32, i as u64, LONG, posted)?);
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(50));
                    // Held: nothing has left this process.
                    assert!(dst.to_vec::<u8>().unwrap().iter().all(|&x| x == 0), "a held request landed");
                    assert!(ok.iter().all(|w| !w.is_completed()), "a held request completed");
                }
            }
            // Larger than a batch takes, and a reply larger than a target gathers.
            ok.push(a.start_write(&ms.to_view(4096, Some(big))?, &remote.slice(4096, big as u64)?, LONG)?);
            ok.push(a.start_read(&mb.to_mutable_view(4096, Some(big))?, &remote.slice(4096, big as u64)?, LONG)?);
            // Waiting inside the batch sends what it holds.
            ok.pop().map(|w| w.wait(LONG)).transpose()?;
            Ok((ok, refused))
        })
        .unwrap();
    for w in ok {
        w.wait(LONG).unwrap();
    }
    for w in refused {
        let e = w.wait(LONG).unwrap_err();
        assert!(e.to_string().contains("unknown remote buffer"), "{e}");
    }
    let (s, d, r) = (src.to_vec::<u8>().unwrap(), dst.to_vec::<u8>().unwrap(), back.to_vec::<u8>().unwrap());
    for i in 0..64 {
        let at = i * 64;
        assert_eq!(&d[at..at + 60], &s[at..at + 60], "block {i}");
        assert_eq!(&r[at..at + 60], &s[at..at + 60], "block {i} read back");
        assert_eq!(u32_at(&dst, at + 60), i as u32, "word {i}");
    }
    assert_eq!(&d[4096..], &s[4096..]);
    assert_eq!(&r[4096..], &s[4096..]);
    assert!(gone.to_vec::<u8>().unwrap().iter().all(|&x| x == 0));
}

/// Posted requests are done once sent (the owner, kept from serving by what `block` returns,
/// answers none), land in order, and a close returns only once the owner has served them.
pub(crate) fn posted_requests_land_in_order_and_a_close_fences_them<G>(
    a: Transport,
    b: &Transport,
    block: impl FnOnce() -> G,
) {
    let dst = Tensor::zeros(&[64 + 8], DType::U8).unwrap();
    let remote = b.register_memory(&dst).unwrap().to_remote_buffer().unwrap();
    let src: Vec<u8> = (0..16 * 64).map(|i| (i / 64) as u8 + 1).collect();
    let src = Tensor::from_slice(&[src.len()], &src).unwrap();
    let ms = a.register_memory(&src).unwrap();
    let word = Tensor::zeros(&[8], DType::U8).unwrap();
    let mw = a.register_memory_read_only(&word).unwrap();
    // A slot put is never posted: it is answered (the slot may be busy).
    a.start_atomic(&mw.to_view(0, Some(4)).unwrap(), &remote.slice(68, 4).unwrap(), Atomic::SlotPut, 1, LONG, true)
        .unwrap()
        .wait(LONG)
        .unwrap();
    let held = block();
    for i in 0..16 {
        let w = a.post_write(&ms.to_view(i * 64, Some(64)).unwrap(), &remote.slice(0, 64).unwrap(), LONG);
        // Done once sent: no answer is awaited (the blocked owner could give none).
        w.unwrap().wait(LONG).unwrap();
    }
    let last = remote.slice(64, 4).unwrap();
    a.start_atomic(&mw.to_view(0, Some(4)).unwrap(), &last, Atomic::Set32, 77, LONG, true).unwrap().wait(LONG).unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let closing = {
        let closed = closed.clone();
        std::thread::spawn(move || {
            let r = a.close(LONG);
            closed.store(true, Ordering::Release);
            r
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    // Closing fences: it waits for the owner to serve what was posted.
    assert!(!closed.load(Ordering::Acquire), "close returned before the posted requests landed");
    drop(held);
    closing.join().unwrap().unwrap();
    let d = dst.to_vec::<u8>().unwrap();
    assert!(d[..64].iter().all(|&x| x == 16), "in order, the last write lands last");
    assert_eq!(u32_at(&dst, 64), 77);
    assert_eq!(u32_at(&dst, 68), 1);
}

/// A refused posted write has no Work left to fail: the connection carries the refusal, and
/// later requests fail as the peer lost.
pub(crate) fn a_refused_posted_write_ends_the_connection_with_the_reason(a: &Transport, b: &Transport) {
    let gone = Tensor::zeros(&[64], DType::U8).unwrap();
    let m = b.register_memory(&gone).unwrap();
    let stale = m.to_remote_buffer().unwrap();
    b.unregister_memory(&m).unwrap();
    let src = Tensor::zeros(&[8], DType::U8).unwrap();
    let ms = a.register_memory(&src).unwrap();
    let sent = a.post_write(&ms.to_view(0, None).unwrap(), &stale.slice(0, 8).unwrap(), LONG).unwrap().wait(LONG);
    let t = std::time::Instant::now();
    while a.connected() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    match sent {
        // Refused before it was done sending (ucx): its own Work heard.
        Err(e) => assert!(e.to_string().contains("unknown remote buffer"), "{e}"),
        Ok(()) => {
            assert!(!a.connected(), "a refused posted write left the connection up");
            let why = a.disconnect_reason().unwrap_or_default();
            assert!(why.contains("refused a posted request") && why.contains("unknown remote buffer"), "{why}");
            let e = a.start_write(&ms.to_view(0, None).unwrap(), &stale, LONG).unwrap_err();
            assert_eq!(e.transfer_kind(), Some(crate::error::TransferKind::PeerLost), "{e}");
        }
    }
}
