//! Every public entry that takes a size, an offset, a count or a split, given any values (huge,
//! negative, overflowing): it answers `Ok` with something inside its memory, or a clear
//! invalid-argument error; it never panics, wraps around, or touches memory outside. CI runs
//! this file with overflow checks off too (`cargo test --profile checked --test checked`, as in
//! release), where unchecked arithmetic would wrap instead of panicking.

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use symmem::Group;
use symmem::ops::{self, ReduceOp};
use symmem::store::MemoryStore;
use symmem::symm::{self, Device, SymmHandle};
use symmem::tensor::{DType, Tensor};
use symmem::transport::{Options, RemoteBuffer, new_transport};

/// Sizes that matter: small ones, and ones near every overflow.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..70,
        Just(usize::MAX),
        Just(usize::MAX / 2 + 1),
        Just(1 << 32),
        Just(1 << 62),
        (0usize..8).prop_map(|k| usize::MAX / 8 * k + 1),
        any::<usize>(),
    ]
}

fn i64s() -> impl Strategy<Value = i64> {
    prop_oneof![-3i64..40, Just(i64::MAX), Just(i64::MIN), Just(i64::MAX - 1), Just(i64::MAX / 2 + 1), any::<i64>()]
}

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn invalid<T: std::fmt::Debug>(r: &symmem::Result<T>) -> bool {
    matches!(r, Err(symmem::Error::InvalidArgument(_)))
}

/// A one-rank world with a 4096-byte symmetric buffer, shared by the properties.
fn world() -> &'static (Group, Tensor, Arc<SymmHandle>) {
    static W: OnceLock<(Group, Tensor, Arc<SymmHandle>)> = OnceLock::new();
    W.get_or_init(|| {
        let g = Group::new(0, 1, Arc::new(MemoryStore::new())).unwrap();
        let x = symm::empty(&[4096], DType::U8, Device::Cpu).unwrap();
        let h = symm::rendezvous(&x, &g).unwrap();
        (g, x, h)
    })
}

/// Whether `t`'s elements lie inside `[base, base + len)`.
fn inside(t: &Tensor, base: usize, len: usize) -> bool {
    let es = t.dtype().size();
    let start = t.data_ptr() as usize;
    if t.shape().contains(&0) {
        return start >= base && start <= base + len;
    }
    let last: usize = t.shape().iter().zip(t.strides()).map(|(&d, &s)| (d - 1) * s).sum();
    start >= base && start + (last + 1) * es <= base + len
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tensor_views(
        shape in proptest::collection::vec(size(), 0..4),
        strides in proptest::collection::vec(size(), 0..4),
        offset in size(),
        d in dtype(),
    ) {
        let bytes = Tensor::zeros(&[4096], DType::U8).unwrap();
        let base = bytes.data_ptr() as usize;
        let r = bytes.reinterpret(d, &shape, &strides, offset);
        match &r {
            Ok(t) => prop_assert!(inside(t, base, 4096), "{shape:?} {strides:?} at {offset}"),
            Err(_) => prop_assert!(invalid(&r)),
        }
        if let Ok(t) = r {
            prop_assert_eq!(t.to_vec::<u8>().map(|v| v.len()).unwrap_or(t.numel()), t.numel());
        }
    }

    #[test]
    fn narrow_tile_and_view(dim in 0usize..3, start in size(), len in size(), shape in proptest::collection::vec(size(), 0..3)) {
        let t = Tensor::zeros(&[8, 16], DType::F32).unwrap();
        let base = t.data_ptr() as usize;
        let r = t.narrow(dim, start, len);
        match &r {
            Ok(n) => prop_assert!(inside(n, base, 512) && n.shape()[dim] == len),
            Err(_) => prop_assert!(invalid(&r)),
        }
        let r = t.tile(start..start.saturating_add(len % 9), 0..len % 17);
        match &r {
            Ok(n) => prop_assert!(inside(n, base, 512)),
            Err(_) => prop_assert!(invalid(&r)),
        }
        let r = t.view(&shape);
        match &r {
            Ok(n) => prop_assert!(n.numel() == 128 && inside(n, base, 512)),
            Err(_) => prop_assert!(invalid(&r)),
        }
    }

    #[test]
    fn allocations_of_any_shape(shape in proptest::collection::vec(size(), 1..3), d in dtype()) {
        // Shapes that fit in a megabyte are made; shapes whose size overflows, or exceeds the
        // machine's memory (2^48 bytes is beyond any machine here), are refused, never
        // attempted (a shared-memory file would take pages until the OOM killer came).
        // A shape with a zero dimension is empty, however large the others.
        let bytes = if shape.contains(&0) { Some(0) } else { shape.iter().try_fold(d.size(), |n, &x| n.checked_mul(x)) };
        // Between a megabyte and the machine's memory: real allocations, not tried here.
        if bytes.is_some_and(|b| b > 1 << 20 && b < 1 << 48) {
            return Ok(());
        }
        let shared = [symm::empty(&shape, d, Device::Cpu), symmem::transport::shm::alloc(&shape, d)];
        match bytes {
            Some(b) if b <= 1 << 20 => {
                for r in shared.into_iter().chain([Tensor::zeros(&shape, d)]) {
                    prop_assert_eq!(r.unwrap().nbytes(), b);
                }
            }
            Some(b) if b >= 1 << 48 => prop_assert!(shared.iter().all(|r| r.is_err())),
            None => {
                prop_assert!(shared.iter().all(|r| r.is_err()));
                prop_assert!(Tensor::zeros(&shape, d).is_err());
            }
            Some(_) => {}
        }
    }

    #[test]
    fn peer_buffers(sizes in proptest::collection::vec(size(), 0..3), d in dtype(), offset in size(), n in size()) {
        let (_, x, h) = world();
        let base = x.data_ptr() as usize;
        let r = h.get_buffer(0, &sizes, d, offset);
        match &r {
            Ok(t) => prop_assert!(inside(t, base, 4096)),
            Err(_) => prop_assert!(invalid(&r)),
        }
        let r = h.get_remote_tensor(0, &sizes, d);
        match &r {
            Ok(t) => prop_assert!(inside(t, base, 4096)),
            Err(_) => prop_assert!(invalid(&r)),
        }
        let dst = Tensor::zeros(&[64], DType::U8).unwrap();
        let r = symm::get(&dst, h, 0, offset);
        prop_assert!(r.is_ok() == (offset <= 4096 - 64), "get at {offset}: {r:?}");
        let r = symm::nvshmem_get_out(&dst, h, offset, n, 0);
        prop_assert!(r.is_ok() || invalid(&r), "{r:?}");
        if r.is_ok() {
            prop_assert!(n <= 64 && offset.checked_add(n).is_some_and(|e| e <= 4096));
        }
    }

    #[test]
    fn transport_views_and_descriptors(offset in size(), length in proptest::option::of(size()), so in any::<u64>(), sl in any::<u64>()) {
        let t = new_transport("shm", None, &Options::new()).unwrap();
        let m = t.register_memory(&Tensor::zeros(&[256], DType::U8).unwrap()).unwrap();
        let r = m.to_view(offset, length);
        match &r {
            Ok(v) => prop_assert!(offset <= 256 && v.size() <= 256 - offset),
            Err(_) => prop_assert!(invalid(&r)),
        }
        let rb = m.to_remote_buffer().unwrap();
        let r = rb.slice(so, sl);
        match &r {
            Ok(s) => prop_assert!(so.checked_add(sl).is_some_and(|e| e <= 256) && s.len() == sl),
            Err(_) => prop_assert!(invalid(&r)),
        }
        // Descriptors with any offset and length decode only when they cannot overflow.
        let text = format!(
            r#"{{"version":1,"backend":"shm","fields":{{"buffer_id":1,"offset":{so},"length":{sl},"access_key":"AAAAAAAAAAAAAAAAAAAAAA==","writable":1,"endpoint":0}}}}"#
        );
        let r = RemoteBuffer::deserialize(text.as_bytes());
        prop_assert!(r.is_ok() == so.checked_add(sl).is_some(), "{r:?}");
        t.close(None).unwrap();
    }

    #[test]
    fn all_to_all_splits(split in i64s(), ne in 1usize..4, offs in proptest::collection::vec(i64s(), 1..4), align in size()) {
        let (g, _, _) = world();
        let input = symm::empty(&[8, 2], DType::F32, Device::Cpu).unwrap();
        let out = Tensor::zeros(&[32, 2], DType::F32).unwrap();
        let one = symm::empty(&[1], DType::I64, Device::Cpu).unwrap();
        one.copy_from_slice(&[split]).unwrap();
        let oso = Tensor::zeros(&[2, 1], DType::I64).unwrap();
        let r = ops::all_to_all_vdev(&input, &out, &one, &oso, g);
        prop_assert!(r.is_ok() == (0..=8).contains(&split), "vdev {split}: {r:?}");
        // 2-D dispatch with `ne` experts, every split `split`.
        let splits = symm::empty(&[ne], DType::I64, Device::Cpu).unwrap();
        splits.copy_from_slice(&vec![split; ne]).unwrap();
        let oso2 = symm::empty(&[2, ne], DType::I64, Device::Cpu).unwrap();
        let r = ops::all_to_all_vdev_2d(&input, &out, &splits, &oso2, g, Some(align));
        prop_assert!(r.is_ok() || invalid(&r), "{r:?}");
        if r.is_ok() {
            let so = oso2.to_vec::<i64>().unwrap();
            prop_assert!(so[ne..].iter().zip(&so[..ne]).all(|(&o, &l)| o >= 0 && o + l <= 32));
        }
        // 2-D combine from any offsets.
        let n = offs.len();
        let iso = symm::empty(&[2, n], DType::I64, Device::Cpu).unwrap();
        iso.copy_from_slice(&[vec![split; n], offs.clone()].concat()).unwrap();
        let back = Tensor::zeros(&[2, n], DType::I64).unwrap();
        let r = ops::all_to_all_vdev_2d_offset(&input, &out, &iso, &back, g);
        let fits = offs.iter().all(|&o| o >= 0 && split >= 0 && o.checked_add(split).is_some_and(|e| e <= 8))
            && split.checked_mul(n as i64).is_some_and(|t| t <= 32);
        prop_assert!(r.is_ok() == fits, "2d_offset {split} at {offs:?}: {r:?}");
    }

    #[test]
    fn offset_reductions_and_roots(offsets in proptest::collection::vec(size(), 0..4), dim in 0usize..3, root in size()) {
        let (g, _, _) = world();
        let input = symm::empty(&[4, 8], DType::F32, Device::Cpu).unwrap();
        let outs: Vec<Tensor> = vec![];
        let r = ops::reduce_scatter_offset(&input, &outs, g, dim, Some(&offsets), None, ReduceOp::Sum);
        prop_assert!(r.is_ok() || invalid(&r), "{r:?}");
        let r = ops::broadcast_(&input, root, g);
        prop_assert!(r.is_ok() == (root == 0), "{r:?}");
        let tile = input.tile(0..2, 0..4).unwrap();
        let r = ops::tile_reduce(&tile, &Tensor::zeros(&[2, 4], DType::F32).unwrap(), root, g, ReduceOp::Max);
        prop_assert!(r.is_ok() == (root == 0), "{r:?}");
    }
}
