//! Guards on the hot paths (`cargo bench --bench hot_paths`): each is one call a program makes
//! in its inner loop, measured in one process (ranks on threads, a transport connected to a
//! second endpoint of this process), so a regression shows in review. The multi-process
//! figures with their baselines (Open MPI, memcpy, a TCP ping-pong) are `symmem bench ...`.
//!
//! - `shm_write/8B_shared`, `shm_write/8B_heap`, `shm_write/64KiB_shared`: the synchronous
//!   transport write (its fast path: no Work); `shm_start_write_wait/8B_shared`: the same
//!   through a Work.
//! - `all_reduce/8B_2ranks`: the small all-reduce between two thread ranks;
//!   `all_reduce/1MiB_{float32,bfloat16,float16}_2ranks`: 1 MiB of each, where the reduction
//!   kernel (and for bf16 and f16 its conversions) is most of the time.
//! - `signal/pingpong_2ranks`: a signal-pad put and the peer's wait, there and back.
//! - `store/add` and `store/barrier_2ranks`: one TcpStore round trip; the group barrier.

#![allow(missing_docs, reason = "a benchmark binary")]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use symmem::group::run_threads;
use symmem::ops::{self, ReduceOp};
use symmem::store::{ClientOptions, ServerOptions, Store, StoreServer, TcpStore};
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};
use symmem::transport::{Options, new_transport};

const T: Duration = Duration::from_secs(60);

fn transport(c: &mut Criterion) {
    let a = new_transport("shm", None, &Options::new()).unwrap();
    let b = new_transport("shm", None, &Options::new()).unwrap();
    let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
    a.connect(&ub, None).unwrap();
    b.connect(&ua, None).unwrap();
    let src = symmem::transport::shm::alloc(&[65536], DType::U8).unwrap();
    let mine = a.register_memory(&src).unwrap();
    let shared = b.register_memory(&symmem::transport::shm::alloc(&[65536], DType::U8).unwrap()).unwrap();
    let heap = b.register_memory(&Tensor::zeros(&[65536], DType::U8).unwrap()).unwrap();
    let mut g = c.benchmark_group("shm_write");
    for (name, target, len) in [("8B_shared", &shared, 8), ("8B_heap", &heap, 8), ("64KiB_shared", &shared, 65536)] {
        let view = mine.to_view(0, Some(len)).unwrap();
        let remote = target.to_remote_buffer().unwrap().slice(0, len as u64).unwrap();
        g.bench_function(name, |bench| bench.iter(|| a.write(&view, &remote, Some(T)).unwrap()));
    }
    g.finish();
    let view = mine.to_view(0, Some(8)).unwrap();
    let remote = shared.to_remote_buffer().unwrap().slice(0, 8).unwrap();
    c.bench_function("shm_start_write_wait/8B_shared", |bench| {
        bench.iter(|| a.start_write(&view, &remote, Some(T)).unwrap().wait(None).unwrap())
    });
}

/// Times `iters` rounds of `rank0` on rank 0 while rank 1 runs `rank1` as many times; both on
/// fresh thread ranks with their setup done before the clock starts.
fn two_ranks<S: Send>(
    iters: u64,
    setup: impl Fn(&symmem::Group) -> S + Sync,
    rank0: impl Fn(&symmem::Group, &S) + Sync,
    rank1: impl Fn(&symmem::Group, &S) + Sync,
) -> Duration {
    let times = run_threads(2, |g| {
        let s = setup(&g);
        g.barrier(T)?;
        let start = Instant::now();
        for _ in 0..iters {
            if g.rank() == 0 { rank0(&g, &s) } else { rank1(&g, &s) }
        }
        Ok(start.elapsed())
    })
    .unwrap();
    times[0]
}

fn collectives(c: &mut Criterion) {
    c.bench_function("all_reduce/8B_2ranks", |bench| {
        bench.iter_custom(|iters| {
            let setup = |g: &symmem::Group| {
                let x = symm::empty(&[2], DType::F32, Device::Cpu).unwrap();
                symm::rendezvous(&x, g).unwrap();
                x
            };
            let run = |g: &symmem::Group, x: &Tensor| ops::all_reduce(x, ReduceOp::Sum, g).unwrap();
            two_ranks(iters, setup, run, run)
        })
    });
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        c.bench_function(&format!("all_reduce/1MiB_{dtype}_2ranks"), |bench| {
            bench.iter_custom(|iters| {
                let setup = |g: &symmem::Group| {
                    let x = symm::empty(&[(1 << 20) / dtype.size()], dtype, Device::Cpu).unwrap();
                    symm::rendezvous(&x, g).unwrap();
                    x
                };
                let run = |g: &symmem::Group, x: &Tensor| ops::all_reduce(x, ReduceOp::Sum, g).unwrap();
                two_ranks(iters, setup, run, run)
            })
        });
    }
    c.bench_function("signal/pingpong_2ranks", |bench| {
        bench.iter_custom(|iters| {
            let setup = |g: &symmem::Group| {
                let x = symm::empty(&[64], DType::U8, Device::Cpu).unwrap();
                symm::rendezvous(&x, g).unwrap()
            };
            let ping = |_: &symmem::Group, h: &Arc<symm::SymmHandle>| {
                h.put_signal(1, 0, T).unwrap();
                h.wait_signal(1, 0, T).unwrap();
            };
            let pong = |_: &symmem::Group, h: &Arc<symm::SymmHandle>| {
                h.wait_signal(0, 0, T).unwrap();
                h.put_signal(0, 0, T).unwrap();
            };
            two_ranks(iters, setup, ping, pong)
        })
    });
}

fn store(c: &mut Criterion) {
    let server = StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap();
    let addr = server.local_addr().to_string();
    let options = ClientOptions { timeout: T, secret: None };
    let client = TcpStore::connect(&addr, options.clone()).unwrap();
    c.bench_function("store/add", |bench| bench.iter(|| client.add("bench/add", 1).unwrap()));
    // Two ranks on threads, each with its own connection, barrier after barrier.
    let (go, went) = mpsc::channel::<u64>();
    let (done, finished) = mpsc::channel::<()>();
    let other = std::thread::spawn({
        let (addr, options) = (addr.clone(), options.clone());
        move || {
            let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&addr, options).unwrap());
            let g = symmem::Group::new(1, 2, store).unwrap();
            for iters in went {
                for _ in 0..iters {
                    g.barrier(T).unwrap();
                }
                done.send(()).unwrap();
            }
        }
    });
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&addr, options).unwrap());
    let g = symmem::Group::new(0, 2, store).unwrap();
    c.bench_function("store/barrier_2ranks", |bench| {
        bench.iter_custom(|iters| {
            go.send(iters).unwrap();
            let start = Instant::now();
            for _ in 0..iters {
                g.barrier(T).unwrap();
            }
            let d = start.elapsed();
            finished.recv().unwrap();
            d
        })
    });
    drop(go);
    other.join().unwrap();
}

criterion_group! {
    name = hot_paths;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = transport, collectives, store
}
criterion_main!(hot_paths);
