//! `transport::lag_sends`, the late-link fault injection the cross-host tests use
//! (`cli/tests/trust.rs`, `cli/tests/hosts.rs`). In a test binary of its own: the lag is
//! process-wide, and would make every test running beside it late.

#![allow(clippy::print_stderr, reason = "skips explain themselves")]

use std::time::{Duration, Instant};

use symmem::Error;
use symmem::tensor::{DType, Tensor};
use symmem::transport::{self, Options, Transport, new_transport};

/// Two connected endpoints of `backend`, or `None` (and why) where it cannot run.
fn pair(backend: &str) -> Option<(Transport, Transport)> {
    let a = match new_transport(backend, None, &Options::new()) {
        Ok(t) => t,
        Err(e @ Error::Unsupported { .. }) => {
            eprintln!("SKIPPED: the {backend} backend is unavailable here: {e}");
            return None;
        }
        Err(e) => panic!("{backend}: {e}"),
    };
    let b = new_transport(backend, None, &Options::new()).unwrap();
    let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
    a.connect(&ub, None).unwrap();
    b.connect(&ua, None).unwrap();
    Some((a, b))
}

/// 16 writes of 8 bytes to one place, write k carrying the value k: what lands last is the
/// last one started only if they land in order. Returns how long they took to complete.
fn sixteen_writes(a: &Transport, b: &Transport, early: impl Fn(&Tensor)) -> Duration {
    let values: Vec<i64> = (1..=16).collect();
    let src = Tensor::from_slice(&[16], &values).unwrap();
    let dst = Tensor::zeros(&[1], DType::I64).unwrap();
    let (ms, md) = (a.register_memory(&src).unwrap(), b.register_memory(&dst).unwrap());
    let remote = md.to_remote_buffer().unwrap();
    let t = Instant::now();
    let works: Vec<_> =
        (0..16).map(|k| a.start_write(&ms.to_view(8 * k, Some(8)).unwrap(), &remote, None).unwrap()).collect();
    early(&dst);
    for w in works {
        w.wait(Some(Duration::from_secs(30))).unwrap();
    }
    let took = t.elapsed();
    assert_eq!(dst.to_vec::<i64>().unwrap(), [16], "the writes landed in the order they were started");
    took
}

#[test]
fn lagged_requests_land_late_and_in_order() {
    for backend in ["tcp", "ucx"] {
        let Some((a, b)) = pair(backend) else { continue };
        transport::lag_sends(Duration::from_millis(300));
        let took = sixteen_writes(&a, &b, |dst| {
            // Started well inside the lag: nothing may have landed yet.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(dst.to_vec::<i64>().unwrap(), [0], "{backend}: a lagged write landed early");
        });
        assert!(took >= Duration::from_millis(300), "{backend}: lagged writes completed after {took:?}");
        // Back to no lag: the transport keeps handing its requests to its lag thread (so the
        // order holds across the change), now at once.
        transport::lag_sends(Duration::ZERO);
        let took = sixteen_writes(&a, &b, |_| {});
        assert!(took < Duration::from_millis(300), "{backend}: writes not lagged took {took:?}");
        a.close(None).unwrap();
        b.close(None).unwrap();
    }
}
