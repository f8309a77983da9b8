//! Write your own operator: a one-shot all-reduce built from nothing but a symmetric tensor's
//! handle — every rank's buffer address and the signal-pad barrier — the way the spec's "Write
//! your own kernel" section does it with Triton.
//!
//! Run it with `cargo run --release --example custom_all_reduce` (it launches 4 ranks of itself
//! through symmem's launcher), or under any launcher: `symmem run -n 4 -- <this binary>`.
//!
//! The recipe for any custom operator:
//! 1. allocate with `symm::empty` and `rendezvous` once (the handle is cached);
//! 2. `barrier` so every rank's input is in place (it orders memory: what a rank wrote before
//!    the barrier is visible to every rank after it);
//! 3. read (or write) peers' buffers through `buffer_ptrs()`;
//! 4. `barrier` again before anyone may overwrite a buffer a peer could still be reading.

use std::time::{Duration, Instant};

use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};

/// out[i] = sum over ranks r of input_r[i], in rank order (bitwise identical on every rank).
fn my_all_reduce(input: &Tensor, out: &mut [f32], group: &symmem::Group) -> symmem::Result<()> {
    let h = symm::rendezvous(input, group)?;
    let n = input.numel();
    h.barrier(0, Duration::from_secs(30))?;
    let peers: Vec<&[f32]> = h
        .buffer_ptrs()?
        .iter()
        // SAFETY: every rank's buffer holds `n` f32 at the handle's offset (rendezvous checked
        // the shapes), it stays mapped while `h` lives, and no rank writes it between the two
        // barriers.
        .map(|&p| unsafe { std::slice::from_raw_parts((p + h.offset()) as *const f32, n) })
        .collect();
    out.copy_from_slice(peers[0]);
    for peer in &peers[1..] {
        for (o, x) in out.iter_mut().zip(peer.iter()) {
            *o += x;
        }
    }
    h.barrier(0, Duration::from_secs(30))
}

fn main() -> symmem::Result<()> {
    if std::env::var("RANK").is_err() {
        // Started directly: launch 4 ranks of this program.
        let exe = std::env::current_exe().map_err(|e| symmem::Error::io("find this example", e))?;
        let outcome = symmem::launch::run(&symmem::launch::LaunchOptions::local(4, exe, Vec::new()))?;
        std::process::exit(outcome.exit_code());
    }
    let group = symmem::Group::from_env()?;
    let (rank, ws) = (group.rank(), group.world_size());
    let n = 1 << 16;
    let x = symm::empty(&[n], DType::F32, Device::Cpu)?;
    x.copy_from_slice(&(0..n).map(|i| (rank * n + i) as f32).collect::<Vec<_>>())?;
    let mut out = vec![0.0f32; n];
    let t = Instant::now();
    for _ in 0..100 {
        my_all_reduce(&x, &mut out, &group)?;
    }
    let each = t.elapsed() / 100;
    // Check against the closed form: sum over r of (r·n + i).
    let ok = out.iter().enumerate().all(|(i, &v)| v == (0..ws).map(|r| (r * n + i) as f32).sum::<f32>());
    // Compare with the built-in one-shot operator on the same tensor.
    let builtin = symmem::ops::one_shot_all_reduce(&x, symmem::ops::ReduceOp::Sum, &group)?;
    let same = builtin.to_vec::<f32>()? == out;
    let mut stdout = std::io::stdout().lock();
    use std::io::Write;
    let _ = writeln!(
        stdout,
        "rank {rank}: custom all-reduce of {n} floats: {each:?} each, correct: {ok}, matches ops::one_shot_all_reduce: {same}"
    );
    if !(ok && same) {
        std::process::exit(1);
    }
    Ok(())
}
