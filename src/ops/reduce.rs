//! Reduction kernels: `dst[i] = op(src_0[i], src_1[i], ..., src_{n-1}[i])`, always combined in
//! source order, so every rank computing the same reduction gets bitwise-identical results.
//!
//! Elements are loaded into an accumulator type (f16 and bf16 accumulate in f32, as DeepSpeed
//! and PyTorch do), reduced chunk by chunk through a stack buffer (so the inner loops are plain
//! slices the compiler vectorizes, and `dst` may be one of the sources), then stored back. The
//! first two sources meet in one pass, and the last goes straight into a single destination:
//! two sources into one destination is one pass over memory, not three (`run`).

use std::mem::MaybeUninit;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::tensor::DType;

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum,
    /// Sum divided by the number of ranks (integers truncate).
    Avg,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
}

impl ReduceOp {
    /// A stable number for this reduction (collective checks compare it across ranks).
    pub(crate) fn code(self) -> u64 {
        self as u64 + 1
    }

    /// Parses `sum`, `avg`, `min` or `max`.
    pub fn parse(s: &str) -> Result<ReduceOp> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "reduce_op {other:?} is not supported (sum, avg, min, max)"
                )));
            }
        })
    }
}

/// An accumulator.
trait Acc: Copy + Default {
    fn add(self, o: Self) -> Self;
    fn lesser(self, o: Self) -> Self;
    fn greater(self, o: Self) -> Self;
    fn div(self, n: usize) -> Self;
}

macro_rules! float_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self + o }
            #[inline(always)]
            fn lesser(self, o: Self) -> Self { if o < self { o } else { self } }
            #[inline(always)]
            fn greater(self, o: Self) -> Self { if o > self { o } else { self } }
            #[inline(always)]
            fn div(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
float_acc!(f32, f64);

macro_rules! int_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)]
            fn lesser(self, o: Self) -> Self { self.min(o) }
            #[inline(always)]
            fn greater(self, o: Self) -> Self { self.max(o) }
            #[inline(always)]
            fn div(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
int_acc!(i8, i16, i32, i64, u8, u32);

/// An element and how it accumulates.
trait Elem: Copy + bytemuck::Pod {
    type A: Acc;
    /// Whether conversions element by element vectorize, so the kernel's loops combine
    /// elements as they load them (`run`); otherwise the kernel converts whole chunks first
    /// (`run_chunked`): f16, whose conversions are vector instructions behind a run-time check.
    const FUSED: bool = true;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
    /// Loads a chunk (the same length as `dst`).
    fn load_chunk(src: &[Self], dst: &mut [Self::A]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.load();
        }
    }
    /// Stores a chunk (the same length as `src`).
    fn store_chunk(src: &[Self::A], dst: &mut [Self]) {
        for (d, a) in dst.iter_mut().zip(src) {
            *d = Self::store(*a);
        }
    }
}

macro_rules! same_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            type A = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(a: $t) -> $t { a }
        }
    )*};
}
same_elem!(f32, f64, i8, i16, i32, i64, u8, u32);

/// f16 converts through `half`'s slice conversions: F16C (8 lanes) where the CPU has it,
/// checked once per chunk; element by element, the check and the scalar conversion made f16
/// sums 30 times slower than f32's. The same instructions as `f16::to_f32` and `from_f32` use
/// there, so the same bits.
impl Elem for f16 {
    type A = f32;
    const FUSED: bool = false;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> f16 {
        f16::from_f32(a)
    }
    fn load_chunk(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store_chunk(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// bf16 converts without branches, so the kernel's loops vectorize (`half`'s conversions branch
/// on NaN and on rounding, which kept bf16 sums 7 times slower than f32's); the same bits as
/// `half`'s: NaNs made quiet, round to nearest even.
impl Elem for bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        let i = u32::from(self.to_bits());
        let nan = i & 0x7FFF > 0x7F80;
        f32::from_bits((i | if nan { 0x40 } else { 0 }) << 16)
    }
    #[inline(always)]
    fn store(a: f32) -> bf16 {
        let x = a.to_bits();
        let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
        // Round to nearest, ties to even: adding 0x7FFF and the kept part's lowest bit carries
        // into it exactly when the dropped half is above the midpoint, or on it and odd.
        let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
        let quiet = ((x >> 16) | 0x40) as u16;
        bf16::from_bits(if nan { quiet } else { rounded })
    }
}

/// Elements per chunk: the accumulator buffer stays in L1.
const CHUNK: usize = 1024;

/// How a destination chunk lies relative to a source chunk of the same length.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lie {
    /// The same elements.
    Same,
    /// No element in common.
    Apart,
    /// Partly overlapping: only the accumulator path is safe.
    Overlap,
}

fn lie(dst: *const u8, src: *const u8, bytes: usize) -> Lie {
    let (d, s) = (dst as usize, src as usize);
    if d == s {
        Lie::Same
    } else if d.abs_diff(s) >= bytes {
        Lie::Apart
    } else {
        Lie::Overlap
    }
}

/// Reduces `n` elements of each source into `dst` (any `dst` may also be a source); with no
/// source, nothing is written.
///
/// # Safety
///
/// Every pointer must be valid for `n` elements of `dtype`, aligned for it, and no other thread
/// or process may write those elements during the call (the callers' barriers guarantee it).
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    ranks: usize,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    {
        // Only bf16, whose conversions keep the loops busy: f32 (memory-bound) ran 1.3-1.4
        // times slower at 4 ranks (256 KiB, 1 MiB) built for AVX-512, and f16's conversions
        // are half's own (F16C).
        if dtype == DType::BF16 && has_avx512() {
            // SAFETY: forwarded from this function's contract; the CPU has AVX-512 F, BW and
            // VL (checked).
            return unsafe { reduce_avx512(dtype, op, srcs, dsts, n, ranks) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: forwarded from this function's contract; the CPU has AVX2 (checked).
            return unsafe { reduce_avx2(dtype, op, srcs, dsts, n, ranks) };
        }
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { reduce_any(dtype, op, srcs, dsts, n, ranks) }
}

/// Defines `$name`: [`reduce`] compiled with the target features `$features` (the same
/// operations in the same order as the baseline build, so the same bits).
macro_rules! built_for {
    ($(#[$doc:meta])* $name:ident, $features:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        ///
        /// As for [`reduce`], on a CPU with these features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            dtype: DType,
            op: ReduceOp,
            srcs: &[*const u8],
            dsts: &[*mut u8],
            n: usize,
            ranks: usize,
        ) -> Result<()> {
            // SAFETY: forwarded.
            unsafe { reduce_any(dtype, op, srcs, dsts, n, ranks) }
        }
    };
}

built_for!(
    /// [`reduce`] for AVX2: 256-bit loops, and bf16's conversions vectorized at all (the
    /// baseline x86-64 target's SSE2 leaves them scalar).
    reduce_avx2,
    "avx2"
);

built_for!(
    /// [`reduce`] for AVX-512, for bf16: its conversions 16 lanes at a time (1.6-1.9 times
    /// the AVX2 build's speed).
    reduce_avx512,
    "avx512f,avx512bw,avx512vl"
);

/// Whether the CPU has what [`reduce_avx512`] is compiled for.
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// [`reduce`] for whatever target it is compiled into (inlined whole into [`reduce_avx2`] and
/// [`reduce_avx512`]).
///
/// # Safety
///
/// As for [`reduce`].
#[inline(always)]
unsafe fn reduce_any(
    dtype: DType,
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    ranks: usize,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match dtype {
            DType::F32 => typed::<f32>(op, srcs, dsts, n, ranks),
            DType::F64 => typed::<f64>(op, srcs, dsts, n, ranks),
            DType::F16 => typed::<f16>(op, srcs, dsts, n, ranks),
            DType::BF16 => typed::<bf16>(op, srcs, dsts, n, ranks),
            DType::I8 => typed::<i8>(op, srcs, dsts, n, ranks),
            DType::I16 => typed::<i16>(op, srcs, dsts, n, ranks),
            DType::I32 => typed::<i32>(op, srcs, dsts, n, ranks),
            DType::I64 => typed::<i64>(op, srcs, dsts, n, ranks),
            DType::U8 => typed::<u8>(op, srcs, dsts, n, ranks),
            DType::U32 => typed::<u32>(op, srcs, dsts, n, ranks),
            DType::Bool => return Err(Error::InvalidArgument("reductions of bool tensors are not supported".into())),
        }
    }
    Ok(())
}

/// # Safety
///
/// As for [`reduce`].
#[inline(always)]
unsafe fn typed<T: Elem>(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, ranks: usize) {
    // SAFETY: forwarded.
    unsafe {
        match op {
            ReduceOp::Sum => run::<T, _>(srcs, dsts, n, |a, b| a.add(b), None),
            ReduceOp::Avg => run::<T, _>(srcs, dsts, n, |a, b| a.add(b), Some(ranks)),
            ReduceOp::Min => run::<T, _>(srcs, dsts, n, |a, b| a.lesser(b), None),
            ReduceOp::Max => run::<T, _>(srcs, dsts, n, |a, b| a.greater(b), None),
        }
    }
}

/// The kernel. Per chunk of `CHUNK` elements: the first two sources combined into the
/// accumulator in one pass, each further source folded in, and, with one destination and no
/// division, the last source combined straight into the destination (a pass over the
/// accumulator and a copy fewer); two sources into one destination take one pass in all. The
/// order of combination is always source order, whatever the path, so results are the same
/// bits. A destination that is one of the sources is written in place through that source's
/// elements only; one that partly overlaps a source takes the accumulator path (every source of
/// a chunk read before any destination is written).
///
/// # Safety
///
/// As for [`reduce`].
#[inline(always)]
unsafe fn run<T: Elem, F: Fn(T::A, T::A) -> T::A>(
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    f: F,
    avg: Option<usize>,
) {
    if !T::FUSED {
        // SAFETY: forwarded.
        return unsafe { run_chunked::<T, F>(srcs, dsts, n, f, avg) };
    }
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let size = std::mem::size_of::<T>();
    // The one destination the last source may go straight into.
    let out = match dsts {
        [d] if avg.is_none() => Some(*d),
        _ => None,
    };
    // Uninitialized: the sources fill what a chunk uses (zeroing all of it cost a 4-8 KiB
    // memset per call, a fifth of a small all-reduce).
    let mut acc = [const { MaybeUninit::<T::A>::uninit() }; CHUNK];
    let mut at = 0;
    while at < n {
        let k = (n - at).min(CHUNK);
        // Where slices of sources and destinations are alive together (the loops below): a
        // shared slice of a source and a mutable one of a destination only where `lie` found
        // them apart; a destination that is a source is accessed only through its mutable
        // slice while that is alive.
        let src = |p: &*const u8| {
            // SAFETY: the caller guarantees `n` valid, aligned elements of each source,
            // unwritten by anyone else; [at, at+k) is inside them (aliasing: see above).
            unsafe { std::slice::from_raw_parts(p.cast::<T>().add(at), k) }
        };
        let dst = |p: &*mut u8| {
            // SAFETY: as for `src`, for the destinations.
            unsafe { std::slice::from_raw_parts_mut(p.cast::<T>().add(at), k) }
        };
        let bytes = k * size;
        let at_b = at * size;
        let rel = |d: *mut u8, s: &*const u8| lie(d.wrapping_add(at_b), s.wrapping_add(at_b), bytes);
        // Two sources into one destination: one pass.
        if let (Some(d), [second]) = (out, rest) {
            match (rel(d, first), rel(d, second)) {
                (Lie::Same, Lie::Apart) => {
                    for (o, x) in dst(&d).iter_mut().zip(src(second)) {
                        *o = T::store(f(o.load(), x.load()));
                    }
                    at += k;
                    continue;
                }
                (Lie::Apart, Lie::Same) => {
                    for (o, x) in dst(&d).iter_mut().zip(src(first)) {
                        *o = T::store(f(x.load(), o.load()));
                    }
                    at += k;
                    continue;
                }
                (Lie::Apart, Lie::Apart) => {
                    for ((o, x), y) in dst(&d).iter_mut().zip(src(first)).zip(src(second)) {
                        *o = T::store(f(x.load(), y.load()));
                    }
                    at += k;
                    continue;
                }
                _ => {}
            }
        }
        // The last source straight into the destination, when it may be.
        let last = match (out, rest.split_last()) {
            (Some(d), Some((l, mid))) if !mid.is_empty() && rel(d, l) != Lie::Overlap => Some((d, l)),
            _ => None,
        };
        let folded = if last.is_some() { &rest[..rest.len() - 1] } else { rest };
        match folded.split_first() {
            Some((second, _)) => {
                for ((a, x), y) in acc[..k].iter_mut().zip(src(first)).zip(src(second)) {
                    a.write(f(x.load(), y.load()));
                }
            }
            None => {
                for (a, x) in acc[..k].iter_mut().zip(src(first)) {
                    a.write(x.load());
                }
            }
        }
        // SAFETY: the loops above wrote all k elements (the sources have k), and
        // MaybeUninit<A> has A's layout.
        let acc = unsafe { &mut *(std::ptr::from_mut(&mut acc[..k]) as *mut [T::A]) };
        for s in folded.iter().skip(1) {
            for (a, x) in acc.iter_mut().zip(src(s)) {
                *a = f(*a, x.load());
            }
        }
        if let Some((d, l)) = last {
            if rel(d, l) == Lie::Same {
                for (o, a) in dst(&d).iter_mut().zip(acc.iter()) {
                    *o = T::store(f(*a, o.load()));
                }
            } else {
                for ((o, a), x) in dst(&d).iter_mut().zip(acc.iter()).zip(src(l)) {
                    *o = T::store(f(*a, x.load()));
                }
            }
            at += k;
            continue;
        }
        if let Some(ranks) = avg {
            for a in acc.iter_mut() {
                *a = a.div(ranks);
            }
        }
        // Every source of this chunk has been read into `acc` already, so writing a
        // destination that is also a source is fine.
        let Some((d0, more)) = dsts.split_first() else {
            at += k;
            continue;
        };
        for (o, a) in dst(d0).iter_mut().zip(acc.iter()) {
            *o = T::store(*a);
        }
        for d in more {
            // SAFETY: every destination holds `n` elements (the kernel's contract) and d0's
            // chunk was just written.
            unsafe {
                copy_converted::<T>(*d0, *d, at, k, || {
                    for (o, a) in dst(d).iter_mut().zip(acc.iter()) {
                        *o = T::store(*a);
                    }
                });
            }
        }
        at += k;
    }
}

/// Fills chunk [at, at+k) of destination `d` with what the first destination `d0` got: for an
/// element type that converts from its accumulator (bf16, f16), a copy of `d0`'s chunk, which
/// costs less than converting again (two-shot writes every local rank's buffer); otherwise
/// `store`, as for `d0`.
///
/// # Safety
///
/// Both destinations are valid for at least `at + k` elements of `T` and written by nobody
/// else, and chunk [at, at+k) of `d0` is final.
#[inline(always)]
unsafe fn copy_converted<T: Elem>(d0: *mut u8, d: *mut u8, at: usize, k: usize, store: impl FnOnce()) {
    if std::mem::size_of::<T>() == std::mem::size_of::<T::A>() {
        return store();
    }
    // SAFETY: by the contract above; `copy` allows the two to be the same buffer.
    unsafe { std::ptr::copy(d0.cast::<T>().add(at).cast_const(), d.cast::<T>().add(at), k) };
}

/// The kernel for elements that convert a chunk at a time (`Elem::FUSED` false): each
/// source's chunk converted into a buffer and combined into the accumulator, in source order,
/// then stored into every destination (every source of a chunk read before any destination of
/// it is written).
///
/// # Safety
///
/// As for [`reduce`].
#[inline(always)]
unsafe fn run_chunked<T: Elem, F: Fn(T::A, T::A) -> T::A>(
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    f: F,
    avg: Option<usize>,
) {
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let mut acc = [T::A::default(); CHUNK];
    let mut tmp = [T::A::default(); CHUNK];
    let mut at = 0;
    while at < n {
        let k = (n - at).min(CHUNK);
        // SAFETY: the caller guarantees `n` valid, aligned elements of each source, unwritten by
        // anyone else; [at, at+k) is inside them. Each slice lives only for its conversion.
        let src = |p: &*const u8| unsafe { std::slice::from_raw_parts(p.cast::<T>().add(at), k) };
        let acc = &mut acc[..k];
        T::load_chunk(src(first), acc);
        for s in rest {
            T::load_chunk(src(s), &mut tmp[..k]);
            for (a, x) in acc.iter_mut().zip(&tmp[..k]) {
                *a = f(*a, *x);
            }
        }
        if let Some(ranks) = avg {
            for a in acc.iter_mut() {
                *a = a.div(ranks);
            }
        }
        // Every source of this chunk has been read (and its slice dropped), so a destination
        // that is also a source may be written.
        let store = |d: &*mut u8| {
            // SAFETY: as for the sources, for a destination.
            T::store_chunk(acc, unsafe { std::slice::from_raw_parts_mut(d.cast::<T>().add(at), k) });
        };
        if let Some((d0, more)) = dsts.split_first() {
            store(d0);
            for d in more {
                // SAFETY: every destination holds `n` elements (the kernel's contract) and d0's
                // chunk was just stored.
                unsafe { copy_converted::<T>(*d0, *d, at, k, || store(d)) };
            }
        }
        at += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce_vecs<T: Elem>(dtype: DType, op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
        let n = inputs[0].len();
        let mut out = vec![T::zeroed(); n];
        let srcs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr().cast()).collect();
        // SAFETY: every vector has n elements and nothing else touches them.
        unsafe { reduce(dtype, op, &srcs, &[out.as_mut_ptr().cast()], n, inputs.len()).unwrap() };
        out
    }

    #[test]
    fn every_op_and_dtype_family() {
        let a: Vec<f32> = (0..3000).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..3000).map(|i| 1000.0 - i as f32).collect();
        let sum = reduce_vecs(DType::F32, ReduceOp::Sum, &[a.clone(), b.clone()]);
        assert!(sum.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.5 + 1000.0 - i as f32));
        let avg = reduce_vecs(DType::F32, ReduceOp::Avg, &[a.clone(), b.clone()]);
        assert_eq!(avg[10], (5.0 + 990.0) / 2.0);
        let min = reduce_vecs(DType::F32, ReduceOp::Min, &[a.clone(), b.clone()]);
        let max = reduce_vecs(DType::F32, ReduceOp::Max, &[a.clone(), b.clone()]);
        assert_eq!((min[0], max[0], min[2999], max[2999]), (0.0, 1000.0, -1999.0, 1499.5));
        let i: Vec<i8> = vec![100, -100, 7];
        assert_eq!(reduce_vecs(DType::I8, ReduceOp::Sum, &[i.clone(), i.clone()]), vec![-56, 56, 14], "wraps");
        assert_eq!(reduce_vecs(DType::I8, ReduceOp::Avg, &[i.clone(), vec![0, 0, 0]]), vec![50, -50, 3]);
        // bf16 accumulates in f32: 256 + 1 + 1 would lose both ones in bf16, not in f32.
        let x = |v: f32| bf16::from_f32(v);
        let r = reduce_vecs(DType::BF16, ReduceOp::Sum, &[vec![x(256.0)], vec![x(1.0)], vec![x(1.0)]]);
        assert_eq!(r[0].to_f32(), 258.0);
        let h = |v: f32| f16::from_f32(v);
        assert_eq!(reduce_vecs(DType::F16, ReduceOp::Max, &[vec![h(-1.0)], vec![h(2.5)]])[0].to_f32(), 2.5);
    }

    type Kernel = unsafe fn(DType, ReduceOp, &[*const u8], &[*mut u8], usize, usize) -> Result<()>;

    /// The builds of the kernel this CPU runs, and their names.
    fn kernels() -> Vec<(Kernel, &'static str)> {
        let mut k: Vec<(Kernel, &'static str)> = vec![(reduce_any, "baseline")];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                k.push((reduce_avx2, "avx2"));
            }
            if has_avx512() {
                k.push((reduce_avx512, "avx512"));
            }
        }
        k
    }

    /// Every path of the kernel (two sources in one pass, the last source into the destination,
    /// the accumulator) against a plain fold in source order, bit for bit: destinations apart
    /// from the sources or each one of them, one or two destinations, every op, across chunk
    /// boundaries, with NaNs and signed zeros (whose min and max depend on the order).
    #[test]
    fn every_path_folds_in_source_order_bit_for_bit() {
        fn reference<T: Elem>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
            let f = |a: T::A, b: T::A| match op {
                ReduceOp::Sum | ReduceOp::Avg => a.add(b),
                ReduceOp::Min => a.lesser(b),
                ReduceOp::Max => a.greater(b),
            };
            (0..inputs[0].len())
                .map(|i| {
                    let mut a = inputs[0][i].load();
                    for v in &inputs[1..] {
                        a = f(a, v[i].load());
                    }
                    if op == ReduceOp::Avg {
                        a = a.div(inputs.len());
                    }
                    T::store(a)
                })
                .collect()
        }
        fn check<T: Elem + std::fmt::Debug>(dtype: DType, make: impl Fn(usize, usize) -> T) {
            let n = 2 * CHUNK + 37;
            for ranks in 1..=5 {
                let inputs: Vec<Vec<T>> = (0..ranks).map(|r| (0..n).map(|i| make(r, i)).collect()).collect();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
                    let want: Vec<u8> = bytemuck::cast_slice(&reference(op, &inputs)).to_vec();
                    // None: a destination of its own; Some(j): source j is the destination.
                    for into in std::iter::once(None).chain((0..ranks).map(Some)) {
                        // Every build of the kernel this CPU runs.
                        for (two, (kernel, name)) in
                            [false, true].into_iter().flat_map(|two| kernels().into_iter().map(move |k| (two, k)))
                        {
                            let mut bufs = inputs.clone();
                            let mut own = vec![T::zeroed(); n];
                            let mut extra = vec![T::zeroed(); n];
                            let srcs: Vec<*const u8> = bufs.iter().map(|v| v.as_ptr().cast()).collect();
                            let mut dsts = vec![match into {
                                None => own.as_mut_ptr().cast::<u8>(),
                                Some(j) => bufs[j].as_mut_ptr().cast::<u8>(),
                            }];
                            if two {
                                dsts.push(extra.as_mut_ptr().cast());
                            }
                            // SAFETY: every buffer holds n elements; a destination that is a
                            // source is the same buffer, which `reduce` allows.
                            unsafe { kernel(dtype, op, &srcs, &dsts, n, ranks).unwrap() };
                            let got = match into {
                                None => own.clone(),
                                Some(j) => std::mem::take(&mut bufs[j]),
                            };
                            let what = format!("{dtype:?} {op:?} {ranks} sources into {into:?}, two: {two}, {name}");
                            assert_eq!(bytemuck::cast_slice::<T, u8>(&got), &want[..], "{what}");
                            if two {
                                assert_eq!(bytemuck::cast_slice::<T, u8>(&extra), &want[..], "{what}");
                            }
                        }
                    }
                }
            }
        }
        let special = [f32::NAN, -0.0, 0.0, f32::INFINITY, -1.5];
        let float = |r: usize, i: usize| {
            if (i + r).is_multiple_of(7) {
                special[(i / 7 + r) % special.len()]
            } else {
                (i as f32) * 0.37 - (r as f32) * 11.0
            }
        };
        check::<f32>(DType::F32, float);
        check::<bf16>(DType::BF16, |r, i| bf16::from_f32(float(r, i)));
        check::<f16>(DType::F16, |r, i| f16::from_f32(float(r, i) / 64.0));
        check::<f64>(DType::F64, |r, i| f64::from(float(r, i)));
        check::<i8>(DType::I8, |r, i| (i * 31 + r * 17) as i8);
        check::<i64>(DType::I64, |r, i| (i as i64 - 1000) * (r as i64 + 1) * 1_000_000_007);
    }

    /// The kernel's own conversions give `half`'s bits: every bf16 loaded, f32 values around
    /// every bf16 rounding boundary (and NaNs, infinities, subnormals) stored, and f16 chunks
    /// both ways against `half`'s scalar conversions.
    #[test]
    fn conversions_match_half_bit_for_bit() {
        for b in 0..=u16::MAX {
            let (h, k) = (bf16::from_bits(b).to_f32(), bf16::from_bits(b).load());
            assert_eq!(h.to_bits(), k.to_bits(), "bf16 {b:#06x} loaded");
        }
        for hi in 0..=u32::from(u16::MAX) {
            for lo in [0u32, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xFFFF] {
                let x = f32::from_bits(hi << 16 | lo);
                assert_eq!(bf16::from_f32(x).to_bits(), bf16::store(x).to_bits(), "f32 {:#010x} stored", hi << 16 | lo);
            }
        }
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let halves: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        let mut wide = vec![0f32; halves.len()];
        for (src, dst) in halves.chunks(CHUNK).zip(wide.chunks_mut(CHUNK)) {
            f16::load_chunk(src, dst);
        }
        for (h, w) in halves.iter().zip(&wide) {
            assert_eq!(h.to_f32().to_bits(), w.to_bits(), "f16 {:#06x} loaded", h.to_bits());
        }
        let floats: Vec<f32> = (0..=u32::from(u16::MAX))
            .flat_map(|hi| [0u32, 0x0FFF, 0x1000, 0x1001, 0xFFFF].map(|lo| f32::from_bits(hi << 16 | lo)))
            .collect();
        let mut narrow = vec![f16::ZERO; floats.len()];
        for (src, dst) in floats.chunks(CHUNK).zip(narrow.chunks_mut(CHUNK)) {
            f16::store_chunk(src, dst);
        }
        for (x, n) in floats.iter().zip(&narrow) {
            assert_eq!(f16::from_f32(*x).to_bits(), n.to_bits(), "f32 {:#010x} stored", x.to_bits());
        }
    }

    #[test]
    fn partly_overlapping_destinations_take_the_accumulator() {
        // A destination one element past the first source: every source of a chunk is read
        // before the chunk is written, so the chunk's own elements are the originals' sums.
        let mut a: Vec<i32> = (0..3000).collect();
        let b: Vec<i32> = vec![1000; 3000];
        let srcs = [a.as_ptr().cast::<u8>(), b.as_ptr().cast::<u8>()];
        // SAFETY: a has 3000 elements, the destination 2999 of them from its second; `reduce`
        // reads every source of a chunk before writing it, so the overlap only changes later
        // chunks' first source elements.
        unsafe {
            let dst = a.as_mut_ptr().add(1).cast::<u8>();
            reduce(DType::I32, ReduceOp::Sum, &srcs, &[dst], 100, 2).unwrap();
        }
        assert_eq!(a[0], 0);
        assert!((1..=100).all(|i| a[i] == (i as i32 - 1) + 1000), "{:?}", &a[..8]);
    }

    #[test]
    fn in_place_destinations_are_safe() {
        let mut a: Vec<i32> = (0..5000).collect();
        let b: Vec<i32> = (0..5000).map(|i| 2 * i).collect();
        let srcs = [a.as_ptr().cast::<u8>(), b.as_ptr().cast::<u8>()];
        let dst = a.as_mut_ptr().cast::<u8>();
        // SAFETY: both have 5000 elements; a is both a source and the destination, which
        // `reduce` allows.
        unsafe { reduce(DType::I32, ReduceOp::Sum, &srcs, &[dst], 5000, 2).unwrap() };
        assert!(a.iter().enumerate().all(|(i, &v)| v == 3 * i as i32));
    }
}
