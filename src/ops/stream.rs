//! PyTorch's stream writes on the CPU: `stream_write_value32_` stores one 32-bit word and
//! `memset32_` fills a run of them, as `cuStreamWriteValue32` and `cuMemsetD32Async` do on a
//! CUDA stream. There the write is ordered after the stream's earlier work; here after the
//! calling thread's earlier writes.
//!
//! ```text
//!   input   a flat, contiguous uint32 tensor (symmetric or not: a signal word, a flag array)
//!   store   each word with a Release store (a peer's Acquire load of it sees what this
//!           thread wrote before), then a futex wake for whoever sleeps on it
//! ```
//!
//! The checks and messages are PyTorch's (`symm_mem::memset32_`, `symm_mem::stream_write_value32_`).
//! Their signed checks (a negative offset or count, a value past `u32`) happen where the
//! integers arrive typed: in the Python binding, before the call.

use std::sync::atomic::{AtomicU32, Ordering};

use super::common::bad;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Stores `value` into word `offset` of `input`, a flat, contiguous uint32 tensor (PyTorch's
/// `stream_write_value32_`): a Release store, then a wake of whoever sleeps on the word.
///
/// ```
/// use symmem::{DType, Tensor, ops};
///
/// let flags = Tensor::zeros(&[4], DType::U32)?;
/// ops::stream_write_value32_(&flags, 2, 7)?;
/// assert_eq!(flags.to_vec::<u32>()?, [0, 0, 7, 0]);
/// let e = ops::stream_write_value32_(&flags, 4, 1).unwrap_err();
/// assert!(e.to_string().contains("offset (4) exceeded the numel of the input (4)"), "{e}");
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn stream_write_value32_(input: &Tensor, offset: usize, value: u32) -> Result<()> {
    const OP: &str = "stream_write_value32_";
    let words = words(OP, input)?;
    let Some(word) = words.get(offset) else {
        return Err(bad(OP, format!("offset ({offset}) exceeded the numel of the input ({})", words.len())));
    };
    store(input, word, value);
    Ok(())
}

/// Stores `value` into words `offset..offset + count` of `input`, a flat, contiguous uint32
/// tensor (PyTorch's `memset32_`), each with a Release store and a wake of its sleepers.
///
/// ```
/// use symmem::{DType, Tensor, ops};
///
/// let flags = Tensor::zeros(&[8], DType::U32)?;
/// ops::memset32_(&flags, 2, 1, 3)?;
/// assert_eq!(flags.to_vec::<u32>()?, [0, 0, 1, 1, 1, 0, 0, 0]);
/// let e = ops::memset32_(&flags, 6, 1, 3).unwrap_err();
/// assert!(e.to_string().contains("offset + count (9) exceeded the numel of the input (8)"), "{e}");
/// assert!(ops::memset32_(&flags, 0, 1, 0).unwrap_err().to_string().contains("count must be a positive integer"));
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn memset32_(input: &Tensor, offset: usize, value: u32, count: usize) -> Result<()> {
    const OP: &str = "memset32_";
    let words = words(OP, input)?;
    if count == 0 {
        return Err(bad(OP, "count must be a positive integer (got 0)"));
    }
    let end = offset.checked_add(count).filter(|&end| end <= words.len()).ok_or_else(|| {
        bad(
            OP,
            format!(
                "offset + count ({}) exceeded the numel of the input ({})",
                offset as u128 + count as u128,
                words.len()
            ),
        )
    })?;
    for word in &words[offset..end] {
        store(input, word, value);
    }
    Ok(())
}

/// The words of `input`, once it is checked to be a flat, contiguous, aligned uint32 tensor.
fn words<'a>(op: &str, input: &'a Tensor) -> Result<&'a [AtomicU32]> {
    if input.dtype() != DType::U32 || input.shape().len() != 1 || !input.is_contiguous() {
        return Err(bad(op, "input must be a flat, contiguous uint32 tensor"));
    }
    let ptr = input.data_ptr();
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<AtomicU32>()) {
        return Err(bad(op, "input must be 4-byte aligned"));
    }
    if input.numel() == 0 {
        return Ok(&[]);
    }
    // SAFETY: the tensor's `numel` contiguous u32 elements from `data_ptr` lie inside its
    // storage (checked when the view was made), which `input` keeps mapped for 'a; the address
    // is 4-byte aligned (checked above) and AtomicU32 has u32's size. Other threads and
    // processes may write these words concurrently, so they are only touched as atomics.
    Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU32>(), input.numel()) })
}

/// Stores `value` into `word` of `input` and wakes whoever sleeps on it.
fn store(input: &Tensor, word: &AtomicU32, value: u32) {
    // Release: pairs with the Acquire load of a waiter on this word (`SignalWord::load`, or
    // the caller's own poll), so the thread's earlier writes are visible once it sees `value`.
    word.store(value, Ordering::Release);
    crate::sync::wake_word(word, input.storage().sleepers());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_flat_contiguous_uint32_tensors_are_written() {
        let f32s = Tensor::zeros(&[4], DType::F32).unwrap();
        let square = Tensor::zeros(&[2, 2], DType::U32).unwrap();
        let strided = Tensor::zeros(&[8], DType::U32).unwrap().reinterpret(DType::U32, &[4], &[2], 0).unwrap();
        for t in [&f32s, &square, &strided] {
            let e = memset32_(t, 0, 1, 1).unwrap_err().to_string();
            assert!(e.contains("memset32_: input must be a flat, contiguous uint32 tensor"), "{e}");
            let e = stream_write_value32_(t, 0, 1).unwrap_err().to_string();
            assert!(e.contains("stream_write_value32_: input must be a flat, contiguous uint32 tensor"), "{e}");
        }
    }

    #[test]
    fn counts_past_the_end_are_refused_without_overflow_and_nothing_is_written() {
        let t = Tensor::zeros(&[4], DType::U32).unwrap();
        let e = memset32_(&t, usize::MAX, 1, 2).unwrap_err().to_string();
        assert!(e.contains(&format!("offset + count ({}) exceeded", usize::MAX as u128 + 2)), "{e}");
        assert!(memset32_(&t, 3, 1, 2).is_err());
        assert!(stream_write_value32_(&t, usize::MAX, 1).is_err());
        assert_eq!(t.to_vec::<u32>().unwrap(), [0; 4]);
        memset32_(&t, 3, u32::MAX, 1).unwrap();
        assert_eq!(t.to_vec::<u32>().unwrap(), [0, 0, 0, u32::MAX]);
    }
}
