//! A pool of symmetric memory: tensors carved out of large symmetric allocations.
//!
//! Allocation is first-fit over each block's free list, in block order, so every rank that
//! allocates and frees the same sizes in the same order gets the same offsets: the pool's
//! tensors are symmetric. Rendezvous of a pool tensor maps the block once per group; after that
//! every tensor in the block rendezvouses without communication.

use std::sync::{Arc, Mutex, Weak};

use super::{Allocation, lock};
use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};

/// Bytes of each block unless a tensor needs more.
pub const BLOCK_SIZE: usize = 16 << 20;
const ALIGN: usize = 128;

/// A pool of symmetric memory; see the module docs.
#[derive(Debug, Default)]
pub struct MemPool {
    blocks: Mutex<Vec<Block>>,
}

#[derive(Debug)]
struct Block {
    alloc: Arc<Allocation>,
    /// Free ranges `(offset, len)`, sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
}

/// A pool tensor's storage: a range of a block, returned to the pool on drop.
#[derive(Debug)]
struct Slice {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
    pool: Weak<MemPool>,
}

impl MemPool {
    /// An empty pool.
    pub fn new() -> MemPool {
        MemPool::default()
    }

    /// A zeroed-on-first-use symmetric tensor from the pool (memory reused from freed tensors
    /// keeps its old contents, as with any caching allocator).
    pub fn empty(self: &Arc<Self>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = crate::tensor::nbytes_of(shape, dtype)
            .ok()
            .and_then(|n| n.max(1).checked_add(ALIGN - 1))
            .map(|n| n / ALIGN * ALIGN)
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} of {dtype} is too large")))?;
        let mut blocks = lock(&self.blocks);
        let found = blocks.iter_mut().find_map(|b| {
            let i = b.free.iter().position(|&(_, len)| len >= bytes)?;
            let (off, len) = b.free[i];
            if len == bytes {
                b.free.remove(i);
            } else {
                b.free[i] = (off + bytes, len - bytes);
            }
            Some((b.alloc.clone(), off))
        });
        let (alloc, offset) = match found {
            Some(f) => f,
            None => {
                let size = bytes.max(BLOCK_SIZE);
                let alloc = Arc::new(Allocation::new(size)?);
                let rest = if size > bytes { vec![(bytes, size - bytes)] } else { vec![] };
                blocks.push(Block { alloc: alloc.clone(), free: rest });
                (alloc, 0)
            }
        };
        drop(blocks);
        let slice = Slice { alloc, offset, len: bytes, pool: Arc::downgrade(self) };
        Ok(Tensor::from_storage(Arc::new(slice), shape, dtype))
    }

    /// The number of blocks (symmetric allocations) the pool holds.
    pub fn blocks(&self) -> usize {
        lock(&self.blocks).len()
    }

    fn release(&self, alloc: &Arc<Allocation>, offset: usize, len: usize) {
        let mut blocks = lock(&self.blocks);
        let Some(b) = blocks.iter_mut().find(|b| Arc::ptr_eq(&b.alloc, alloc)) else { return };
        let i = b.free.partition_point(|&(o, _)| o < offset);
        b.free.insert(i, (offset, len));
        // Coalesce with the neighbours.
        if i + 1 < b.free.len() && b.free[i].0 + b.free[i].1 == b.free[i + 1].0 {
            b.free[i].1 += b.free.remove(i + 1).1;
        }
        if i > 0 && b.free[i - 1].0 + b.free[i - 1].1 == b.free[i].0 {
            b.free[i - 1].1 += b.free.remove(i).1;
        }
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.release(&self.alloc, self.offset, self.len);
        }
    }
}

// SAFETY: [offset, offset+len) lies inside the block's data buffer (carved from its free
// list), and the Arc keeps the block mapped.
unsafe impl Storage for Slice {
    fn ptr(&self) -> *mut u8 {
        self.alloc.ptr().wrapping_add(self.offset)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn parent(&self) -> Option<(&(dyn std::any::Any + Send + Sync), usize)> {
        Some((&*self.alloc, self.offset))
    }
    fn shared_file(&self) -> Option<(i32, u64)> {
        self.alloc.shared_file().map(|(fd, at)| (fd, at + self.offset as u64))
    }
    fn sleepers(&self) -> Option<&std::sync::atomic::AtomicU32> {
        self.alloc.sleepers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_reuses_and_coalesces() {
        let pool = Arc::new(MemPool::new());
        let a = pool.empty(&[100], DType::F32).unwrap();
        let b = pool.empty(&[100], DType::F32).unwrap();
        let off = |t: &Tensor| crate::symm::allocation_of(t).unwrap().1;
        assert_eq!((off(&a), off(&b)), (0, 512));
        drop(a);
        let c = pool.empty(&[10], DType::F32).unwrap();
        assert_eq!(off(&c), 0, "reuses the freed range");
        drop(b);
        drop(c);
        let d = pool.empty(&[256], DType::F32).unwrap();
        assert_eq!(off(&d), 0, "freed neighbours coalesced");
        assert_eq!(pool.blocks(), 1);
        let big = pool.empty(&[BLOCK_SIZE], DType::U8).unwrap();
        assert_eq!(pool.blocks(), 2);
        assert_eq!(crate::symm::allocation_of(&big).unwrap().0.buffer_size(), BLOCK_SIZE);
    }
}
