//! Reduction kernels: `dst[i] = op(src_0[i], src_1[i], ..., src_{n-1}[i])`, always combined in
//! source order, so every rank computing the same reduction gets bitwise-identical results.
//!
//! Elements are loaded into an accumulator type (f16 and bf16 accumulate in f32, as DeepSpeed
//! and PyTorch do), reduced chunk by chunk through a stack buffer (so the inner loops are plain
//! slices the compiler vectorizes, and `dst` may be one of the sources), then stored back. The
//! first two sources meet in one pass, and the last goes straight into a single destination:
//! two sources into one destination is one pass over memory, not three (`run`).

use std::mem::MaybeUninit;

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
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
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

impl Elem for f16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> f16 {
        f16::from_f32(a)
    }
}

impl Elem for bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> bf16 {
        bf16::from_f32(a)
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
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let size = std::mem::size_of::<T>();
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
        let out = match dsts {
            [d] if avg.is_none() => Some(*d),
            _ => None,
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
        for d in dsts {
            // Every source of this chunk has been read into `acc` already, so writing a
            // destination that is also a source is fine.
            for (o, a) in dst(d).iter_mut().zip(acc.iter()) {
                *o = T::store(*a);
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
                        for two in [false, true] {
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
                            unsafe { reduce(dtype, op, &srcs, &dsts, n, ranks).unwrap() };
                            let got = match into {
                                None => own.clone(),
                                Some(j) => std::mem::take(&mut bufs[j]),
                            };
                            let what = format!("{dtype:?} {op:?} {ranks} sources into {into:?}, two: {two}");
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
