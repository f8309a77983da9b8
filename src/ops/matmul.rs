//! Fused collective matmuls (`docs/symm-mem-algorithms.md` §4), with
//! `matrixmultiply`'s CPU GEMM. f32 and f64 natively; f16 and bf16 through f32.
//!
//! - `fused_all_gather_matmul`: each shard, in rank order, is copied into the gathered `A` and
//!   multiplied at once, while it is still in cache (a helper thread copying while this one
//!   multiplied cost its start on every call and gained nothing measurable on 2 cores).
//! - `fused_matmul_reduce_scatter`: `A @ B` goes into a per-group symmetric workspace, then
//!   every rank reduces its block from all workspaces in rank order (sum or avg).

use half::{bf16, f16};

use super::common::{bad, barrier, fetch, fetch_shared, stage, symmetric, timeout, workspace};
use super::reduce::{self, ReduceOp};
use crate::error::Result;
use crate::group::Group;
use crate::symm::{self, SymmHandle};
use crate::tensor::{DType, Tensor};

/// `c (m×n, row stride ldc) (+)= a (m×k, lda) @ b (k×n, ldb)`, all row-major f32.
///
/// # Safety
///
/// Each pointer must address its matrix with the given row strides.
#[allow(clippy::too_many_arguments, reason = "a GEMM's shape is its arguments")]
unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: bool,
) {
    // SAFETY: forwarded; matrixmultiply reads a and b and writes c within the given strides.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a,
            lda as isize,
            1,
            b,
            ldb as isize,
            1,
            if acc { 1.0 } else { 0.0 },
            c,
            ldc as isize,
            1,
        )
    }
}

/// As [`sgemm`], for f64.
///
/// # Safety
///
/// As for [`sgemm`].
#[allow(clippy::too_many_arguments, reason = "a GEMM's shape is its arguments")]
unsafe fn dgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f64,
    lda: usize,
    b: *const f64,
    ldb: usize,
    c: *mut f64,
    ldc: usize,
    acc: bool,
) {
    // SAFETY: as in sgemm.
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a,
            lda as isize,
            1,
            b,
            ldb as isize,
            1,
            if acc { 1.0 } else { 0.0 },
            c,
            ldc as isize,
            1,
        )
    }
}

/// A matrix as f32 (a copy for f16/bf16), row-major with row stride `ld`.
fn as_f32(dtype: DType, p: *const u8, rows: usize, cols: usize, ld: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            // SAFETY: the caller's matrix holds rows×cols elements at row stride ld.
            let x = unsafe {
                match dtype {
                    DType::F16 => p.cast::<f16>().add(r * ld + c).read().to_f32(),
                    DType::BF16 => p.cast::<bf16>().add(r * ld + c).read().to_f32(),
                    _ => p.cast::<f32>().add(r * ld + c).read(),
                }
            };
            v.push(x);
        }
    }
    v
}

/// `c (+)= a @ b` in `dtype`, row-major with the given row strides.
///
/// # Safety
///
/// As for [`sgemm`], for elements of `dtype`.
#[allow(clippy::too_many_arguments, reason = "a GEMM's shape is its arguments")]
unsafe fn gemm(
    dtype: DType,
    m: usize,
    k: usize,
    n: usize,
    a: *const u8,
    lda: usize,
    b: *const u8,
    ldb: usize,
    c: *mut u8,
    ldc: usize,
    acc: bool,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match dtype {
            DType::F32 => sgemm(m, k, n, a.cast(), lda, b.cast(), ldb, c.cast(), ldc, acc),
            DType::F64 => dgemm(m, k, n, a.cast(), lda, b.cast(), ldb, c.cast(), ldc, acc),
            _ => {
                let (af, bf) = (as_f32(dtype, a, m, k, lda), as_f32(dtype, b, k, n, ldb));
                let mut cf = if acc { as_f32(dtype, c, m, n, ldc) } else { vec![0.0; m * n] };
                sgemm(m, k, n, af.as_ptr(), k, bf.as_ptr(), n, cf.as_mut_ptr(), n, acc);
                for r in 0..m {
                    for col in 0..n {
                        let x = cf[r * n + col];
                        match dtype {
                            DType::F16 => c.cast::<f16>().add(r * ldc + col).write(f16::from_f32(x)),
                            _ => c.cast::<bf16>().add(r * ldc + col).write(bf16::from_f32(x)),
                        }
                    }
                }
            }
        }
    }
}

fn check_float(op: &str, d: DType) -> Result<()> {
    if !d.is_float() {
        return Err(bad(op, format!("{d} is not a floating-point dtype")));
    }
    Ok(())
}

/// `A = all_gather(A_shard, gather_dim)`, then `A @ B` for every `B`, each shard multiplied as
/// soon as it is gathered. `A_shard` is a 2-D tensor: a symmetric one is read where it is, an
/// ordinary one (any strides) is first copied into the group's workspace, as PyTorch's copies
/// it into its symmetric workspace. `gather_dim` 0 stacks the shards' rows, 1 (the last
/// dimension) their columns. Returns `A` when `return_a`.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Each rank holds 1 row of A; every rank gets A (2 x 2) @ B.
///     let shard = symm::empty(&[1, 2], DType::F32, Device::Cpu)?;
///     shard.fill(group.rank() as f32 + 1.0)?;
///     let b = Tensor::from_slice(&[2, 1], &[1.0f32, 1.0])?;
///     let (a, outs) = ops::fused_all_gather_matmul(&shard, &[b], 0, &group, true)?;
///     assert_eq!(a.expect("return_a").to_vec::<f32>()?, [1.0, 1.0, 2.0, 2.0]);
///     assert_eq!(outs[0].to_vec::<f32>()?, [2.0, 4.0]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn fused_all_gather_matmul(
    a_shard: &Tensor,
    bs: &[Tensor],
    gather_dim: usize,
    group: &Group,
    return_a: bool,
) -> Result<(Option<Tensor>, Vec<Tensor>)> {
    const OP: &str = "fused_all_gather_matmul";
    let ws = group.world_size();
    if a_shard.shape().len() != 2 {
        return Err(bad(OP, "A_shard must be a matrix"));
    }
    check_float(OP, a_shard.dtype())?;
    let (m, k) = (a_shard.shape()[0], a_shard.shape()[1]);
    if gather_dim > 1 {
        return Err(bad(OP, format!("gather_dim {gather_dim} is out of range for a matrix")));
    }
    let kk = if gather_dim == 1 { k * ws } else { k };
    for b in bs {
        if b.shape().len() != 2 {
            return Err(bad(OP, "B must be a matrix"));
        }
        if b.shape()[0] != kk || b.dtype() != a_shard.dtype() || !b.is_contiguous() {
            return Err(bad(
                OP,
                format!("B of shape {:?} {} cannot multiply the gathered A (inner size {kk})", b.shape(), b.dtype()),
            ));
        }
    }
    let staged;
    let a_shard = if symm::is_symm_mem_tensor(a_shard) {
        a_shard
    } else {
        let shapes = bs.iter().flat_map(|b| b.shape().iter().map(|&d| d as u64));
        let args: Vec<u64> = [gather_dim as u64, bs.len() as u64].into_iter().chain(shapes).collect();
        staged = stage(OP, a_shard, group, &args)?;
        &staged
    };
    let h = symmetric(OP, a_shard, group)?;
    let (dtype, es) = (a_shard.dtype(), a_shard.dtype().size());
    let gathered_shape = if gather_dim == 0 { [m * ws, k] } else { [m, k * ws] };
    let a = Tensor::zeros(&gathered_shape, dtype)?;
    let outs: Vec<Tensor> =
        bs.iter().map(|b| Tensor::zeros(&[gathered_shape[0], b.shape()[1]], dtype)).collect::<Result<_>>()?;
    let a_ptr = a.data_ptr() as usize;
    // Copies rank r's shard (at address `src`, readable and unchanged for the call) into its
    // place in A.
    let gather = move |r: usize, src: usize| {
        for row in 0..m {
            let (from, to) = if gather_dim == 0 {
                (src + row * k * es, a_ptr + (r * m + row) * k * es)
            } else {
                (src + row * k * es, a_ptr + (row * k * ws + r * k) * es)
            };
            // SAFETY: shard r is readable and unchanged for the call (the caller's promise); the
            // destination row lies inside A, which outlives every use of this closure.
            unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, k * es) };
        }
    };
    // Multiplies shard r of A, once gathered, by each B (in rank order, so sums are bitwise
    // equal on every rank).
    let multiply = |r: usize| {
        for (b, out) in bs.iter().zip(&outs) {
            let n = b.shape()[1];
            // SAFETY: shard r's rows (gather_dim 0) or columns (1) of A were written before;
            // B and out are contiguous with the shapes checked above.
            unsafe {
                if gather_dim == 0 {
                    gemm(
                        dtype,
                        m,
                        k,
                        n,
                        a.data_ptr().add(r * m * k * es),
                        k,
                        b.data_ptr(),
                        n,
                        out.data_ptr().add(r * m * n * es),
                        n,
                        false,
                    );
                } else {
                    gemm(
                        dtype,
                        m,
                        k,
                        n,
                        a.data_ptr().add(r * k * es),
                        k * ws,
                        b.data_ptr().add(r * k * n * es),
                        n,
                        out.data_ptr(),
                        n,
                        r > 0,
                    );
                }
            }
        }
    };
    // Gathers every rank's shard (rank r's at address `srcs[r]`) into A, multiplying each once
    // it is in place. One thread does both, shard by shard: with a gatherer thread copying while
    // this one multiplied (paired runs on one host, 2 and 4 ranks), a call of 64 B took 20x the
    // time (the thread's start), 64 KiB 1.2-1.9x, 1-2 MiB 1.03-1.07x, 8 MiB no difference shown.
    let run = |srcs: &[usize]| -> Result<()> {
        for (r, &src) in srcs.iter().enumerate() {
            gather(r, src);
            multiply(r);
        }
        Ok(())
    };
    let args = [gather_dim as u64];
    // The pull path, once the ranks entered: shards on other hosts fetched first (one rank of
    // each host for its host), then every shard gathered alike; a barrier.
    let pulled = || -> Result<()> {
        fetch_shared(&h, |_| (0, a_shard.nbytes()))?;
        run(&(0..ws).map(|r| h.read_ptr(r) + h.offset()).collect::<Vec<_>>())?;
        barrier(&h)
    };
    // Pulled on one host; across hosts, as the all-gather: every shard travels once to each
    // other host's leader (host push, within the all-gather's limits; `inputs[r]` is rank r's
    // shard for the length of the call) or is read (pull).
    let finish = |inputs: &[*const u8]| run(&inputs.iter().map(|&p| p as usize).collect::<Vec<_>>());
    let travels = super::all_gather::Travels::All;
    super::all_gather::inputs_to_hosts(&[a_shard], group, &h, OP, None, &args, None, travels, finish, pulled)?;
    Ok((return_a.then_some(a), outs))
}

/// `A @ B`, reduce-scattered across ranks along `scatter_dim` (0: rows, 1: columns) with `sum`
/// or `avg`: rank r gets block r of `Σ_ranks A_rank @ B_rank`.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Σ_ranks A @ B is 2 x 1 of 2s then 4s; rank r gets row r.
///     let a = symm::empty(&[2, 1], DType::F32, Device::Cpu)?;
///     a.fill(1.0f32)?;
///     let b = Tensor::from_slice(&[1, 1], &[group.rank() as f32 + 1.0])?;
///     let out = ops::fused_matmul_reduce_scatter(&a, &b, ReduceOp::Sum, 0, &group)?;
///     assert_eq!(out.to_vec::<f32>()?, [3.0]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn fused_matmul_reduce_scatter(
    a: &Tensor,
    b: &Tensor,
    op: ReduceOp,
    scatter_dim: usize,
    group: &Group,
) -> Result<Tensor> {
    const OP: &str = "fused_matmul_reduce_scatter";
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Err(bad(OP, format!("reduce_op {op:?} is not supported (sum, avg)")));
    }
    if a.shape().len() != 2 || b.shape().len() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(bad(OP, format!("A {:?} and B {:?} are not multipliable matrices", a.shape(), b.shape())));
    }
    if a.dtype() != b.dtype() || !a.is_contiguous() || !b.is_contiguous() {
        return Err(bad(OP, "A and B must be contiguous, of one dtype"));
    }
    check_float(OP, a.dtype())?;
    let ws = group.world_size();
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let extent = if scatter_dim == 0 { m } else { n };
    if scatter_dim > 1 || extent % ws != 0 {
        return Err(bad(
            OP,
            format!("scatter_dim {scatter_dim} of size {extent} must be divisible by world size {ws}"),
        ));
    }
    let (dtype, es) = (a.dtype(), a.dtype().size());
    // The workspace grows collectively with the product's size: ranks must agree on it first.
    let args = [op.code(), scatter_dim as u64, k as u64, n as u64];
    super::check::agree(group, &super::check::Stamp::new(OP, a, 0, &args))?;
    let (ws_tensor, h) = workspace(group, m * n * es)?;
    let mine = (h.read_ptr(h.rank()) + h.offset()) as *mut u8;
    // SAFETY: the workspace holds at least m·n elements; no peer reads it before this rank's
    // next barrier or exchange (across hosts, host push reads a copy, or waits for its sends).
    unsafe { gemm(dtype, m, k, n, a.data_ptr(), k, b.data_ptr(), n, mine, n, false) };
    let me = h.rank();
    let out = if scatter_dim == 0 { Tensor::zeros(&[m / ws, n], dtype)? } else { Tensor::zeros(&[m, n / ws], dtype)? };
    // Reduces this rank's block of every rank's partial (`partials[r]`: rank r's m·n product,
    // of which this rank's block is readable and unchanged for the call) into `out`, in rank
    // order.
    let reduce_mine = |partials: &[*const u8]| -> Result<()> {
        if scatter_dim == 0 {
            let rows = m / ws;
            let srcs: Vec<*const u8> = partials.iter().map(|&p| p.wrapping_add(me * rows * n * es)).collect();
            // SAFETY: row block `me` of every partial (the caller's promise); out holds rows·n
            // elements.
            unsafe { reduce::reduce(dtype, op, &srcs, &[out.data_ptr()], rows * n, ws) }
        } else {
            let cols = n / ws;
            for row in 0..m {
                let srcs: Vec<*const u8> =
                    partials.iter().map(|&p| p.wrapping_add((row * n + me * cols) * es)).collect();
                // SAFETY: as above, one row's column block.
                unsafe { reduce::reduce(dtype, op, &srcs, &[out.data_ptr().add(row * cols * es)], cols, ws)? };
            }
            Ok(())
        }
    };
    // The pull path once every partial is complete (after a barrier, or across hosts the
    // entry meeting host push's calls): the blocks read (row blocks alone, or whole partials
    // shared by a host's ranks), reduced, then a barrier.
    let pulled = || -> Result<()> {
        let outcome = (|| {
            if scatter_dim == 0 {
                fetch(&h, |_| (me * (m / ws) * n * es, (m / ws) * n * es))?;
            } else {
                fetch_shared(&h, |_| (0, m * n * es))?;
            }
            reduce_mine(&super::common::peers(&h, 0))
        })();
        let b = h.barrier(0, timeout());
        outcome.and(b)
    };
    if h.all_local() {
        barrier(&h)?;
        pulled()?;
    } else {
        // Across hosts, as the reduce-scatter ([`select_mrs`]): along rows, each rank's partial
        // travels to each other host's leader as the row blocks of that host's ranks (host
        // push; `inputs[r]` holds, for the length of the call, at least this rank's row block
        // of rank r's partial, where it lies in the whole); along columns, every row holds a
        // block of each rank's and whole partials travel; or the blocks are read (pull).
        let partial = ws_tensor.narrow(0, 0, m * n * es)?;
        let push = select_mrs(partial.nbytes(), scatter_dim, &h) == super::all_gather::Algo::HostPush;
        let theirs = super::all_gather::slices_of((m / ws) * n * es);
        let travels =
            if scatter_dim == 0 { super::all_gather::Travels::Range(&theirs) } else { super::all_gather::Travels::All };
        let parts = [&partial];
        super::all_gather::inputs_to_hosts(
            &parts,
            group,
            &h,
            OP,
            Some(op),
            &args,
            Some(push),
            travels,
            reduce_mine,
            pulled,
        )?;
    }
    Ok(out)
}

/// The algorithm [`fused_matmul_reduce_scatter`] takes for partial products of `bytes` bytes
/// per rank, scattered along `scatter_dim`, on the group of `h` (a symmetric tensor's handle):
/// along rows each rank reads its row block of every partial, as a reduce-scatter split along
/// the first dimension, whose limits it takes ([`crate::ops::reduce_scatter::select`]); along
/// columns every partial travels whole, within a reduce-scatter of whole inputs' limits. Pull
/// on one host.
pub fn select_mrs(bytes: usize, scatter_dim: usize, h: &SymmHandle) -> super::all_gather::Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    let select = if scatter_dim == 0 { super::reduce_scatter::select } else { super::reduce_scatter::select_whole };
    select(bytes, h.max_ranks_per_host(), hosts, h.link_backend())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ordinary shard, even a strided view, is copied into the group's workspace first (as
    /// PyTorch's is into its symmetric workspace) and gives what a symmetric one would; the
    /// caller's shard is left as it was.
    #[test]
    fn an_ordinary_shard_is_staged_through_the_workspace() {
        crate::group::run_threads(2, |group| {
            let r = group.rank() as f32 * 10.0;
            let base = Tensor::from_slice(&[2, 4], &(0..8).map(|i| r + i as f32).collect::<Vec<_>>())?;
            let shard = base.tile(0..2, 0..2)?;
            assert!(!shard.is_contiguous() && !symm::is_symm_mem_tensor(&shard));
            let b = Tensor::from_slice(&[2, 1], &[1.0f32, 1.0])?;
            for _ in 0..2 {
                let (a, outs) = fused_all_gather_matmul(&shard, std::slice::from_ref(&b), 0, &group, true)?;
                let a = a.expect("return_a");
                assert_eq!(a.to_vec::<f32>()?, [0.0, 1.0, 4.0, 5.0, 10.0, 11.0, 14.0, 15.0]);
                assert_eq!(outs[0].to_vec::<f32>()?, [1.0, 9.0, 21.0, 29.0]);
            }
            assert_eq!(shard.to_vec::<f32>()?, [r, r + 1.0, r + 4.0, r + 5.0]);
            Ok(())
        })
        .unwrap();
    }
}
