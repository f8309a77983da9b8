//! Reduction kernels: `dst[i] = op(src_0[i], src_1[i], ..., src_{n-1}[i])`, always combined in
//! source order, so every rank computing the same reduction gets bitwise-identical results.
//!
//! Elements are loaded into an accumulator type (f16 and bf16 accumulate in f32, as DeepSpeed
//! and PyTorch do), reduced chunk by chunk through a stack buffer (so the inner loops are plain
//! slices the compiler vectorizes, and `dst` may be one of the sources), then stored back.

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
    // Uninitialized: the first source fills what a chunk uses (zeroing all of it cost a
    // 4-8 KiB memset per call, a fifth of a small all-reduce).
    let mut acc = [const { MaybeUninit::<T::A>::uninit() }; CHUNK];
    let mut at = 0;
    while at < n {
        let k = (n - at).min(CHUNK);
        // SAFETY: the caller guarantees `n` valid, aligned, unwritten elements of each source;
        // [at, at+k) is inside them. The slice lives only within this iteration.
        let s = unsafe { std::slice::from_raw_parts(first.cast::<T>().add(at), k) };
        for (a, x) in acc[..k].iter_mut().zip(s) {
            a.write(x.load());
        }
        // SAFETY: the loop above wrote all k elements (`s` has k), and MaybeUninit<A> has A's
        // layout.
        let acc = unsafe { &mut *(std::ptr::from_mut(&mut acc[..k]) as *mut [T::A]) };
        for src in rest {
            // SAFETY: as for `s`.
            let s = unsafe { std::slice::from_raw_parts(src.cast::<T>().add(at), k) };
            for (a, x) in acc.iter_mut().zip(s) {
                *a = f(*a, x.load());
            }
        }
        if let Some(ranks) = avg {
            for a in acc.iter_mut() {
                *a = a.div(ranks);
            }
        }
        for dst in dsts {
            // SAFETY: as above; every source of this chunk has been read into `acc` already,
            // so writing a destination that is also a source is fine.
            let d = unsafe { std::slice::from_raw_parts_mut(dst.cast::<T>().add(at), k) };
            for (o, a) in d.iter_mut().zip(acc.iter()) {
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
