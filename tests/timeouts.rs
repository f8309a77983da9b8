//! Any timeout, no panic (issue 51, item 3). A finite but huge timeout (`1e19` s, up to
//! `Duration::MAX`, past what an `Instant` holds) made every wait panic with "overflow when
//! adding duration to instant": store waits, barriers, transfers, `Work::wait`, signals. Such a
//! timeout now means "no deadline": a wait whose condition holds returns, one whose condition
//! comes later waits for it, and nothing panics. Every case runs under a watchdog, so a wait
//! that took a huge timeout as "forever" even though its condition held fails the test instead
//! of hanging it.

#![allow(clippy::print_stderr, reason = "skips explain themselves")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use symmem::group::{self, Group};
use symmem::store::{ClientOptions, MemoryStore, ServerOptions, Store, StoreServer, TcpStore};
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};
use symmem::transport::{Options, RemoteBuffer, Transport, new_transport, new_transport_rank};

/// Timeouts past what an `Instant` can add (the first two), and one it can add with little room
/// left after it.
const HUGE: [Duration; 3] =
    [Duration::MAX, Duration::from_secs(10_000_000_000_000_000_000), Duration::from_secs(1 << 62)];

/// What a wait that must return at once may take, however loaded the machine.
const SOON: Duration = Duration::from_secs(60);

/// Runs `f` on a thread and returns what it returns; fails if it is still running after
/// [`SOON`] (a wait that took a huge timeout as "forever" although its condition held would
/// otherwise hang the test), and passes a panic in `f` on with its message.
fn soon<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(SOON) {
        Ok(v) => {
            worker.join().unwrap();
            v
        }
        // It ended without a value: it panicked.
        Err(RecvTimeoutError::Disconnected) => match worker.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
        Err(RecvTimeoutError::Timeout) => panic!("still waiting after {SOON:?}"),
    }
}

/// Every waiting operation of `store` with every huge timeout, on keys that exist; then a wait
/// for a key that `other` (another client of the same store: a TCP store's client serves one
/// call at a time) sets 200 ms later, which a huge timeout must wait for, not time out at once.
fn store_waits(store: Arc<dyn Store>, other: Arc<dyn Store>) {
    store.set("k", b"v").unwrap();
    for (i, t) in HUGE.into_iter().enumerate() {
        assert_eq!(store.get_timeout("k", t).unwrap(), b"v", "{t:?}");
        store.wait_timeout(&["k"], t).unwrap();
        assert_eq!(store.multi_get_timeout(&["k", "k"], t).unwrap(), [b"v".to_vec(), b"v".to_vec()]);
        let arrive = format!("arrive/{i}");
        store.arrive_and_wait(&["k-old"], &arrive, &[&arrive, "k"], t).unwrap();
    }
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        other.set("late", b"here").unwrap();
    });
    let t0 = Instant::now();
    assert_eq!(store.get_timeout("late", Duration::MAX).unwrap(), b"here");
    assert!(t0.elapsed() >= Duration::from_millis(150), "a wait with no deadline returned before its key was set");
    setter.join().unwrap();
    // The store is still in step: an ordinary wait works, and an ordinary timeout still fires.
    store.wait_timeout(&["k", "late"], Duration::from_secs(10)).unwrap();
    assert!(store.wait_timeout(&["never"], Duration::from_millis(50)).unwrap_err().is_timeout());
}

#[test]
fn memory_store_waits_take_any_timeout() {
    soon(|| {
        let store = Arc::new(MemoryStore::new());
        store_waits(store.clone(), store);
        // A huge default timeout too.
        let s = MemoryStore::with_timeout(Duration::MAX);
        s.set("k", b"v").unwrap();
        assert_eq!(s.get("k").unwrap(), b"v");
    });
}

#[test]
fn tcp_store_waits_take_any_timeout() {
    soon(|| {
        let server = StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap();
        let addr = server.local_addr().to_string();
        let quick = ClientOptions { timeout: Duration::from_secs(10), secret: None };
        let connect = || Arc::new(TcpStore::connect(&addr, quick.clone()).unwrap());
        store_waits(connect(), connect());
        // A client whose own timeout (every request's) is huge connects and is served.
        for (i, t) in HUGE.into_iter().enumerate() {
            let s = TcpStore::connect(&addr, ClientOptions { timeout: t, secret: None }).unwrap();
            assert_eq!(s.get("k").unwrap(), b"v");
            assert_eq!(s.add(&format!("n{i}"), 2).unwrap(), 2);
            assert!(s.check(&["k"]).unwrap());
            s.ping().unwrap();
        }
    });
}

#[test]
fn a_store_server_takes_any_timeout() {
    soon(|| {
        for t in HUGE {
            let options = ServerOptions { request_timeout: t, handshake_timeout: t, ..ServerOptions::default() };
            let server = StoreServer::start("127.0.0.1:0", options).unwrap();
            let quick = ClientOptions { timeout: Duration::from_secs(10), secret: None };
            let s = TcpStore::connect(&server.local_addr().to_string(), quick).unwrap();
            s.set("k", b"v").unwrap();
            assert_eq!(s.get("k").unwrap(), b"v", "{t:?}");
        }
    });
}

#[test]
fn group_barriers_take_any_timeout() {
    soon(|| {
        group::run_threads(2, |g: Group| {
            for t in HUGE {
                g.barrier(t)?;
            }
            let all = g.exchange_bytes("x", &[g.rank() as u8], Duration::MAX)?;
            assert_eq!(all, [vec![0], vec![1]]);
            // Still in step.
            g.barrier(Duration::from_secs(30))
        })
        .unwrap();
    });
}

/// Whether `backend` runs here (UCX may be missing).
fn runs_here(backend: &str) -> bool {
    match new_transport(backend, None, &Options::new()) {
        Ok(t) => t.close(None).is_ok(),
        Err(e) => {
            eprintln!("SKIPPED {backend}: {e}");
            false
        }
    }
}

/// Two endpoints of `backend` with `options`, bound and connected with a huge timeout.
fn pair(backend: &str, options: &Options) -> (Transport, Transport) {
    let a = new_transport(backend, None, options).unwrap();
    let b = new_transport(backend, None, options).unwrap();
    let (ua, ub) = (a.bind(Some(Duration::MAX)).unwrap(), b.bind(Some(Duration::MAX)).unwrap());
    a.connect(&ub, Some(Duration::MAX)).unwrap();
    b.connect(&ua, Some(Duration::MAX)).unwrap();
    (a, b)
}

/// Writes and reads through `a` into `b`'s memory with `timeout` in every call, synchronous
/// and not, then checks the bytes.
fn transfers(a: &Transport, b: &Transport, timeout: Option<Duration>) {
    let n = 70_000; // past shm's and the binding's small-copy paths
    let src = Tensor::from_slice(&[n], &(0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>()).unwrap();
    let dst = Tensor::zeros(&[n], DType::U8).unwrap();
    let back = Tensor::zeros(&[n], DType::U8).unwrap();
    let (ms, md, mb) =
        (a.register_memory(&src).unwrap(), b.register_memory(&dst).unwrap(), a.register_memory(&back).unwrap());
    let remote = RemoteBuffer::deserialize(&md.to_remote_buffer().unwrap().serialize()).unwrap();
    a.write(&ms.to_view(0, None).unwrap(), &remote, timeout).unwrap();
    a.read(&mb.to_mutable_view(0, None).unwrap(), &remote, timeout).unwrap();
    assert_eq!(back.to_vec::<u8>().unwrap(), src.to_vec::<u8>().unwrap());
    let w = a.start_write(&ms.to_view(1, None).unwrap(), &remote, timeout).unwrap();
    w.wait(timeout).unwrap();
    let r = a.start_read(&mb.to_mutable_view(0, None).unwrap(), &remote, timeout).unwrap();
    r.wait(None).unwrap();
    r.wait(Some(Duration::MAX)).unwrap();
    assert_eq!(dst.to_vec::<u8>().unwrap()[..n - 1], src.to_vec::<u8>().unwrap()[1..]);
    a.unregister_memory(&ms).unwrap();
}

#[test]
fn transfers_take_any_timeout() {
    for backend in ["tcp", "shm", "auto", "ucx"] {
        if !runs_here(backend) {
            continue;
        }
        soon(move || {
            let (a, b) = pair(backend, &Options::new());
            for t in HUGE {
                transfers(&a, &b, Some(t));
            }
            // Still in step: an ordinary timeout works after them.
            transfers(&a, &b, Some(Duration::from_secs(10)));
            a.close(Some(Duration::MAX)).unwrap();
            b.close(Some(Duration::MAX)).unwrap();
        });
    }
}

/// A backend's `timeout` option (every call's default) may be any finite number of seconds;
/// past what a `Duration` holds it is the largest. Not finite, or negative, it is refused.
#[test]
fn a_transport_timeout_option_takes_any_finite_number() {
    for backend in ["tcp", "shm", "auto", "ucx"] {
        if !runs_here(backend) {
            continue;
        }
        soon(move || {
            for huge in ["1e19", "1e22", "1e300"] {
                let options: Options = [("timeout".to_string(), huge.to_string())].into();
                let (a, b) = pair(backend, &options);
                transfers(&a, &b, None);
                a.close(None).unwrap();
                b.close(None).unwrap();
            }
            for bad in ["inf", "nan", "-1"] {
                let options: Options = [("timeout".to_string(), bad.to_string())].into();
                let Err(e) = new_transport(backend, None, &options) else { panic!("{backend} took timeout={bad}") };
                assert!(e.to_string().contains("timeout"), "{backend} timeout={bad}: {e}");
            }
        });
    }
}

#[test]
fn new_transport_rank_takes_any_timeout() {
    soon(|| {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let peer =
            std::thread::spawn(move || new_transport_rank("auto", None, &s2, 1, 0, Duration::MAX, &Options::new()));
        let a = new_transport_rank("auto", None, &store, 0, 1, Duration::MAX, &Options::new()).unwrap();
        let b = peer.join().unwrap().unwrap();
        assert!(a.connected() && b.connected());
        transfers(&a, &b, Some(Duration::MAX));
    });
}

#[test]
fn symmetric_memory_waits_take_any_timeout() {
    soon(|| {
        group::run_threads(2, |g: Group| {
            let x = symm::empty(&[64], DType::F32, Device::Cpu)?;
            let h = symm::rendezvous(&x, &g)?;
            let (me, other) = (g.rank(), 1 - g.rank());
            for (channel, t) in HUGE.into_iter().enumerate() {
                h.barrier(channel, t)?;
                // Each rank signals the other, then waits for the other's signal.
                h.put_signal(other, channel, t)?;
                h.wait_signal(other, channel, t)?;
            }
            // A wait with no deadline waits for a signal that comes later.
            if me == 0 {
                std::thread::sleep(Duration::from_millis(200));
                h.put_signal(1, 7, Duration::from_secs(10))?;
            } else {
                let t0 = Instant::now();
                h.wait_signal(0, 7, Duration::MAX)?;
                assert!(
                    t0.elapsed() >= Duration::from_millis(150),
                    "a wait with no deadline returned before its signal"
                );
            }
            // Still in step: an ordinary barrier works on both ranks.
            h.barrier(0, Duration::from_secs(30))?;
            g.barrier(Duration::from_secs(30))
        })
        .unwrap();
    });
}
