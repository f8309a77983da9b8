//! Operators across real processes, against a plain single-process reference.

#![allow(clippy::print_stdout, reason = "rank programs report to the launcher through stdout")]

use std::process::Command;

use half::{bf16, f16};
use symmem::Group;
use symmem::ops::{self, ReduceOp};
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");

fn job(n: usize, scenario: &str) {
    let out = Command::new(BIN)
        .args(["run", "-n", &n.to_string(), "--timeout", "300", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", scenario, "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("SYMMEM_OP_TIMEOUT", "60")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{scenario} on {n} ranks:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..n {
        let done = text.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.ends_with(&format!("rank {r} ok")));
        assert!(done, "rank {r} did not finish:\n{text}");
    }
}

/// The test value of element `i` on `rank`: small integers, exact in every dtype.
fn value(rank: usize, i: usize, signed: bool) -> i64 {
    let v = ((i * 7 + rank * 13) % 23) as i64;
    if signed { v - 11 } else { v }
}

fn signed(d: DType) -> bool {
    !matches!(d, DType::U8 | DType::U32)
}

/// A tensor of `dtype` holding `vals`.
fn tensor_of(dtype: DType, t: &Tensor, vals: &[i64]) {
    match dtype {
        DType::F32 => t.copy_from_slice(&vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => t.copy_from_slice(&vals.iter().map(|&v| v as f64).collect::<Vec<_>>()),
        DType::F16 => t.copy_from_slice(&vals.iter().map(|&v| f16::from_f32(v as f32)).collect::<Vec<_>>()),
        DType::BF16 => t.copy_from_slice(&vals.iter().map(|&v| bf16::from_f32(v as f32)).collect::<Vec<_>>()),
        DType::I8 => t.copy_from_slice(&vals.iter().map(|&v| v as i8).collect::<Vec<_>>()),
        DType::I16 => t.copy_from_slice(&vals.iter().map(|&v| v as i16).collect::<Vec<_>>()),
        DType::I32 => t.copy_from_slice(&vals.iter().map(|&v| v as i32).collect::<Vec<_>>()),
        DType::I64 => t.copy_from_slice(vals),
        DType::U8 => t.copy_from_slice(&vals.iter().map(|&v| v as u8).collect::<Vec<_>>()),
        DType::U32 => t.copy_from_slice(&vals.iter().map(|&v| v as u32).collect::<Vec<_>>()),
        DType::Bool => unreachable!(),
    }
    .unwrap();
}

/// The tensor's values as f64.
fn values(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap(),
        DType::F16 => t.to_vec::<f16>().unwrap().into_iter().map(|v| f64::from(v.to_f32())).collect(),
        DType::BF16 => t.to_vec::<bf16>().unwrap().into_iter().map(|v| f64::from(v.to_f32())).collect(),
        DType::I8 => t.to_vec::<i8>().unwrap().into_iter().map(f64::from).collect(),
        DType::I16 => t.to_vec::<i16>().unwrap().into_iter().map(f64::from).collect(),
        DType::I32 => t.to_vec::<i32>().unwrap().into_iter().map(f64::from).collect(),
        DType::I64 => t.to_vec::<i64>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::U8 => t.to_vec::<u8>().unwrap().into_iter().map(f64::from).collect(),
        DType::U32 => t.to_vec::<u32>().unwrap().into_iter().map(f64::from).collect(),
        DType::Bool => unreachable!(),
    }
}

/// The results' bits: every dtype converts to f64 exactly, so equal f64 bits mean equal bits.
fn bytes(t: &Tensor) -> Vec<u8> {
    values(t).into_iter().flat_map(|f| f.to_bits().to_le_bytes()).collect()
}

fn reference(op: ReduceOp, dtype: DType, ws: usize, i: usize) -> f64 {
    let xs: Vec<i64> = (0..ws).map(|r| value(r, i, signed(dtype))).collect();
    match op {
        ReduceOp::Sum => xs.iter().sum::<i64>() as f64,
        ReduceOp::Min => *xs.iter().min().unwrap() as f64,
        ReduceOp::Max => *xs.iter().max().unwrap() as f64,
        ReduceOp::Avg if dtype.is_float() => xs.iter().sum::<i64>() as f64 / ws as f64,
        ReduceOp::Avg => (xs.iter().sum::<i64>() / ws as i64) as f64,
    }
}

fn close(got: f64, want: f64, dtype: DType) -> bool {
    let tol = match dtype {
        DType::F16 | DType::BF16 => 0.02 * want.abs().max(1.0),
        DType::F32 => 1e-5 * want.abs().max(1.0),
        _ => 0.0,
    };
    (got - want).abs() <= tol
}

const REDUCIBLE: [DType; 10] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::U32,
];

/// Element counts: odd and even, small and past one chunk; aligned to 4 bytes as PyTorch needs.
fn sizes(dtype: DType, ws: usize) -> Vec<usize> {
    let per = (4 / dtype.size()).max(1);
    let mut v = vec![per, 1001 * per, 4097 * per];
    // Divisible by ws·per for reduce_scatter.
    v.push(ws * per * 37);
    v
}

fn agree(g: &Group, what: &str, t: &Tensor) {
    let all = g.all_gather_bytes(what, &bytes(t)).unwrap();
    assert!(all.iter().all(|b| b == &all[0]), "{what}: results differ across ranks");
}

#[test]
#[ignore = "a rank program; run by operators_match_the_reference_on_2_3_4_and_8_ranks"]
fn rank_ops() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, ws) = (g.rank(), g.world_size());
    for dtype in REDUCIBLE {
        for n in sizes(dtype, ws) {
            let x = symm::empty(&[n], dtype, Device::Cpu).unwrap();
            let mine: Vec<i64> = (0..n).map(|i| value(me, i, signed(dtype))).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
                let check = |name: &str, t: &Tensor, range: std::ops::Range<usize>| {
                    let got = values(t);
                    for (k, i) in range.enumerate() {
                        let want = reference(op, dtype, ws, i);
                        assert!(close(got[k], want, dtype), "{name} {op:?} {dtype} n={n} [{i}]: {} vs {want}", got[k]);
                    }
                    agree(&g, &format!("{name}-{op:?}-{dtype}-{n}"), t);
                };
                tensor_of(dtype, &x, &mine);
                let out = ops::one_shot_all_reduce(&x, op, &g).unwrap();
                check("one_shot", &out, 0..n);
                assert_eq!(values(&x), mine.iter().map(|&v| v as f64).collect::<Vec<_>>(), "input untouched");

                let out2 = Tensor::zeros(&[n], dtype).unwrap();
                ops::two_shot_all_reduce_out(&x, op, &g, &out2).unwrap();
                check("two_shot_out", &out2, 0..n);

                tensor_of(dtype, &x, &mine);
                ops::two_shot_all_reduce_(&x, op, &g).unwrap();
                check("two_shot_", &x, 0..n);

                tensor_of(dtype, &x, &mine);
                ops::all_reduce(&x, op, &g).unwrap();
                check("all_reduce", &x, 0..n);

                // PyTorch counts in its vector width: 16, 8 or 4 bytes, the largest dividing the
                // input's size (its offset is 0), at least the element.
                let bytes = n * dtype.size();
                let vector = [16, 8, 4].into_iter().find(|a| bytes.is_multiple_of(*a)).unwrap_or(4).max(dtype.size());
                let divisible = n % (ws * vector / dtype.size()) == 0;
                if !divisible {
                    let rs = Tensor::zeros(&[n / ws], dtype).unwrap();
                    let e = ops::reduce_scatter_out(&x, op, &g, false, &rs).unwrap_err();
                    assert!(e.to_string().contains("divisible by world_size"), "{e}");
                }
                if divisible {
                    tensor_of(dtype, &x, &mine);
                    let per = n / ws;
                    let rs = Tensor::zeros(&[per], dtype).unwrap();
                    ops::reduce_scatter_out(&x, op, &g, false, &rs).unwrap();
                    let got = values(&rs);
                    for (k, i) in (me * per..(me + 1) * per).enumerate() {
                        assert!(
                            close(got[k], reference(op, dtype, ws, i), dtype),
                            "reduce_scatter {op:?} {dtype} [{i}]"
                        );
                    }
                }
            }
            // Data movement, every dtype.
            tensor_of(dtype, &x, &mine);
            let gathered = Tensor::zeros(&[n * ws], dtype).unwrap();
            ops::all_gather_into(&x, &g, &gathered).unwrap();
            let got = values(&gathered);
            for r in 0..ws {
                for i in 0..n {
                    assert_eq!(got[r * n + i], value(r, i, signed(dtype)) as f64, "all_gather {dtype}");
                }
            }
            let root = ws - 1;
            ops::broadcast_(&x, root, &g).unwrap();
            assert_eq!(
                values(&x),
                (0..n).map(|i| value(root, i, signed(dtype)) as f64).collect::<Vec<_>>(),
                "broadcast"
            );
        }
    }
    // All-to-all with a 2-D tensor, equal splits along dim 0.
    let rows = ws * 3;
    let a = symm::empty(&[rows, 5], DType::I32, Device::Cpu).unwrap();
    a.copy_from_slice(&(0..rows * 5).map(|i| (me * 1000 + i) as i32).collect::<Vec<_>>()).unwrap();
    let b = Tensor::zeros(&[rows, 5], DType::I32).unwrap();
    ops::all_to_all(&a, &b, &g).unwrap();
    let got = b.to_vec::<i32>().unwrap();
    for j in 0..ws {
        for k in 0..15 {
            assert_eq!(got[j * 15 + k], (j * 1000 + me * 15 + k) as i32, "all_to_all");
        }
    }
    // Reduce-scatter over the last dimension.
    let m = symm::empty(&[3, ws * 4], DType::F32, Device::Cpu).unwrap();
    m.copy_from_slice(&(0..3 * ws * 4).map(|i| (i * (me + 1)) as f32).collect::<Vec<_>>()).unwrap();
    let o = Tensor::zeros(&[3, 4], DType::F32).unwrap();
    ops::reduce_scatter_out(&m, ReduceOp::Sum, &g, true, &o).unwrap();
    let tri = (ws * (ws + 1) / 2) as f32;
    let want: Vec<f32> =
        (0..3).flat_map(|row| (0..4).map(move |c| ((row * ws * 4 + me * 4 + c) as f32) * tri)).collect();
    assert_eq!(o.to_vec::<f32>().unwrap(), want);
    // Arguments are checked before anything is sent.
    let heap = Tensor::zeros(&[4], DType::F32).unwrap();
    assert!(ops::one_shot_all_reduce(&heap, ReduceOp::Sum, &g).unwrap_err().to_string().contains("symm::empty"));
    let odd = symm::empty(&[3], DType::I8, Device::Cpu).unwrap();
    assert!(ops::one_shot_all_reduce(&odd, ReduceOp::Sum, &g).unwrap_err().to_string().contains("4-byte aligned"));
    assert!(ops::all_to_all(&m, &o, &g).is_err());
    // In place, or out overlapping the input by one element: refused on every rank before
    // anything moves (peers read the input while out is written).
    let err = ops::all_to_all(&a, &a, &g).unwrap_err().to_string();
    assert!(err.contains("overlaps the input"), "{err}");
    let big = symm::empty(&[rows + 1, 5], DType::I32, Device::Cpu).unwrap();
    let (lo, hi) = (big.narrow(0, 0, rows).unwrap(), big.narrow(0, 1, rows).unwrap());
    let err = ops::all_to_all(&lo, &hi, &g).unwrap_err().to_string();
    assert!(err.contains("overlaps the input"), "{err}");
    let err = ops::all_to_all_nd(&lo.view(&[rows, 5]).unwrap(), &lo, 1, 0, &g).unwrap_err().to_string();
    assert!(err.contains("overlaps the input"), "{err}");
    // So are the other operators that write an out while peers read the input.
    let v = symm::empty(&[ws * 4], DType::F32, Device::Cpu).unwrap();
    let overlaps = |r: symmem::Result<()>| r.unwrap_err().to_string().contains("overlaps the input");
    assert!(overlaps(ops::one_shot_all_reduce_out(&v, ReduceOp::Sum, &g, &v)));
    assert!(overlaps(ops::two_shot_all_reduce_out(&v, ReduceOp::Sum, &g, &v)));
    assert!(overlaps(ops::reduce_scatter_out(&v, ReduceOp::Sum, &g, false, &v.narrow(0, 4, 4).unwrap())));
    let gathered = symm::empty(&[ws * 4], DType::F32, Device::Cpu).unwrap();
    assert!(overlaps(ops::all_gather_into(&gathered.narrow(0, 0, 4).unwrap(), &g, &gathered)));
    assert!(ops::broadcast_(&m, ws, &g).is_err());
    assert!(matches!(ops::multimem_all_reduce_(&m, ReduceOp::Sum, &g), Err(symmem::Error::Unsupported { .. })));
    assert!(ReduceOp::parse("product").is_err());
    g.barrier(std::time::Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn operators_match_the_reference_on_2_3_4_and_8_ranks() {
    for n in [2, 3, 4, 8] {
        job(n, "rank_ops");
    }
}

fn i64_symm(vals: &[i64], shape: &[usize]) -> Tensor {
    let t = symm::empty(shape, DType::I64, Device::Cpu).unwrap();
    t.copy_from_slice(vals).unwrap();
    t
}

#[test]
#[ignore = "a rank program; run by all_to_all_v_and_tiles_match_the_reference"]
fn rank_a2av_tiles() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, ws) = (g.rank(), g.world_size());
    let cols = 3;
    let cap = 64;
    // Rows tagged (source rank, row index) so every landing place can be checked.
    let tag = |src: usize, row: usize, c: usize| (src * 10_000 + row * 10 + c) as f32;
    let split = |src: usize, dst: usize| ((src * 3 + dst * 5) % 4) as i64;

    // all_to_all_vdev: src sends split(src, dst) rows to dst.
    let input = symm::empty(&[cap, cols], DType::F32, Device::Cpu).unwrap();
    input.copy_from_slice(&(0..cap * cols).map(|i| tag(me, i / cols, i % cols)).collect::<Vec<_>>()).unwrap();
    let in_splits = i64_symm(&(0..ws).map(|d| split(me, d)).collect::<Vec<_>>(), &[ws]);
    let out = symm::empty(&[cap * ws, cols], DType::F32, Device::Cpu).unwrap();
    let oso = symm::empty(&[2, ws], DType::I64, Device::Cpu).unwrap();
    ops::all_to_all_vdev(&input, &out, &in_splits, &oso, &g).unwrap();
    let so = oso.to_vec::<i64>().unwrap();
    let got = out.to_vec::<f32>().unwrap();
    let mut at = 0;
    for src in 0..ws {
        assert_eq!(so[src], split(src, me), "out_splits");
        assert_eq!(so[ws + src], at as i64, "out_offsets");
        let first: i64 = (0..me).map(|d| split(src, d)).sum();
        for r in 0..split(src, me) as usize {
            for c in 0..cols {
                assert_eq!(got[(at + r) * cols + c], tag(src, first as usize + r, c), "all_to_all_vdev row");
            }
        }
        at += split(src, me) as usize;
    }

    // 2d dispatch then 2d_offset combine restores the input exactly, with and without padding.
    let ne = 3;
    let split2 = |src: usize, i: usize| ((src * 7 + i * 3) % 5) as i64;
    for align in [None, Some(4)] {
        let s2: Vec<i64> = (0..ws * ne).map(|i| split2(me, i)).collect();
        let total: i64 = s2.iter().sum();
        let in2 = i64_symm(&s2, &[ws * ne]);
        let out2 = symm::empty(&[cap * ws, cols], DType::F32, Device::Cpu).unwrap();
        let oso2 = symm::empty(&[2, ws * ne], DType::I64, Device::Cpu).unwrap();
        ops::all_to_all_vdev_2d(&input, &out2, &in2, &oso2, &g, align).unwrap();
        let so2 = oso2.to_vec::<i64>().unwrap();
        for e in 0..ne {
            for src in 0..ws {
                assert_eq!(so2[e * ws + src], split2(src, me * ne + e), "expert-major splits");
            }
        }
        if let Some(a) = align {
            for e in 0..ne {
                assert_eq!(so2[ws * ne + e * ws] % a as i64, 0, "expert segments start aligned");
            }
        }
        let back = symm::empty(&[cap, cols], DType::F32, Device::Cpu).unwrap();
        let back_so = symm::empty(&[2, ws * ne], DType::I64, Device::Cpu).unwrap();
        ops::all_to_all_vdev_2d_offset(&out2, &back, &oso2, &back_so, &g).unwrap();
        let n = total as usize * cols;
        assert_eq!(
            back.to_vec::<f32>().unwrap()[..n],
            input.to_vec::<f32>().unwrap()[..n],
            "round trip restores the input"
        );
        let bso = back_so.to_vec::<i64>().unwrap();
        assert_eq!(bso[..ws * ne], s2[..], "combine splits == in_splits");
        let mut acc = 0;
        for i in 0..ws * ne {
            assert_eq!(bso[ws * ne + i], acc, "combine offsets == exclusive scan");
            acc += s2[i];
        }
    }
    // Bad splits fail on every rank without hanging anyone.
    let bad = i64_symm(&vec![-1; ws], &[ws]);
    assert!(ops::all_to_all_vdev(&input, &out, &bad, &oso, &g).is_err());
    let err = ops::all_to_all_vdev(&input, &input, &in_splits, &oso, &g).unwrap_err().to_string();
    assert!(err.contains("overlaps the input"), "{err}");

    // tile_reduce on a quadrant view; multi_root_tile_reduce with every rank a root.
    let full = symm::empty(&[8, 8], DType::F64, Device::Cpu).unwrap();
    full.copy_from_slice(&(0..64).map(|i| (i * (me + 1)) as f64).collect::<Vec<_>>()).unwrap();
    let quad = full.tile(2..6, 4..8).unwrap();
    let out_tile = Tensor::zeros(&[4, 4], DType::F64).unwrap();
    let root = ws - 1;
    ops::tile_reduce(&quad, &out_tile, root, &g, ReduceOp::Sum).unwrap();
    let tri = (ws * (ws + 1) / 2) as f64;
    if me == root {
        let want: Vec<f64> = (2..6).flat_map(|r| (4..8).map(move |c| ((r * 8 + c) as f64) * tri)).collect();
        assert_eq!(out_tile.to_vec::<f64>().unwrap(), want, "tile_reduce");
    } else {
        assert!(out_tile.to_vec::<f64>().unwrap().iter().all(|&v| v == 0.0), "only the root receives");
    }
    let tiles: Vec<Tensor> = (0..ws).map(|i| full.tile(i % 4 * 2..i % 4 * 2 + 2, 0..2).unwrap()).collect();
    let roots: Vec<usize> = (0..ws).rev().collect();
    let mine = Tensor::zeros(&[2, 2], DType::F64).unwrap();
    ops::multi_root_tile_reduce(&tiles, &mine, &roots, &g, ReduceOp::Max).unwrap();
    let i = ws - 1 - me;
    let want: Vec<f64> =
        (i % 4 * 2..i % 4 * 2 + 2).flat_map(|r| (0..2).map(move |c| ((r * 8 + c) * ws) as f64)).collect();
    assert_eq!(mine.to_vec::<f64>().unwrap(), want, "multi_root_tile_reduce");
    assert!(ops::multi_root_tile_reduce(&tiles, &mine, &vec![0; ws], &g, ReduceOp::Sum).is_err() || ws == 1);
    assert!(ops::tile_reduce(&quad, &out_tile, ws, &g, ReduceOp::Sum).is_err());
    g.barrier(std::time::Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn all_to_all_v_and_tiles_match_the_reference() {
    for n in [2, 3, 4, 8] {
        job(n, "rank_a2av_tiles");
    }
}

#[test]
#[ignore = "a rank program; run by offset_reductions_and_nd_exchanges_match_the_reference"]
fn rank_nd() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, ws) = (g.rank(), g.world_size());
    let val = |r: usize, i: usize| (i * 3 + r * 100) as f32;
    let (rows, cols) = (ws * 4, ws * 6);
    let x = symm::empty(&[rows, cols], DType::F32, Device::Cpu).unwrap();
    x.copy_from_slice(&(0..rows * cols).map(|i| val(me, i)).collect::<Vec<_>>()).unwrap();
    let sum = |i: usize| (0..ws).map(|r| val(r, i)).sum::<f32>();
    // reduce_scatter_offset: uneven blocks, custom owners (reversed), both dims.
    for dim in [0usize, 1] {
        let extent = if dim == 0 { rows } else { cols };
        // 2·ws blocks: pairs of sizes (1, extent/ws - 1), so the j-th owned blocks match in size.
        let mut sizes = Vec::new();
        for _ in 0..ws {
            sizes.push(1);
            sizes.push(extent / ws - 1);
        }
        let offsets: Vec<usize> = sizes
            .iter()
            .scan(0, |a, &s| {
                *a += s;
                Some(*a)
            })
            .collect();
        let dst: Vec<usize> = (0..2 * ws).map(|i| ws - 1 - (i / 2) % ws).collect();
        let owned: Vec<usize> = (0..2 * ws).filter(|&i| dst[i] == me).collect();
        let outs: Vec<Tensor> = owned
            .iter()
            .map(|&i| {
                let s = sizes[i];
                let shape = if dim == 0 { [s, cols] } else { [rows, s] };
                Tensor::zeros(&shape, DType::F32).unwrap()
            })
            .collect();
        ops::reduce_scatter_offset(&x, &outs, &g, dim, Some(&offsets), Some(&dst), ReduceOp::Sum).unwrap();
        for (j, &i) in owned.iter().enumerate() {
            let start = offsets[i] - sizes[i];
            let got = outs[j].to_vec::<f32>().unwrap();
            let want: Vec<f32> = if dim == 0 {
                (start * cols..(start + sizes[i]) * cols).map(sum).collect()
            } else {
                (0..rows).flat_map(|r| (start..start + sizes[i]).map(move |c| r * cols + c)).map(sum).collect()
            };
            assert_eq!(got, want, "reduce_scatter_offset dim {dim} block {i}");
        }
    }
    // Default equal blocks, round-robin owners.
    let out = Tensor::zeros(&[rows / ws, cols], DType::F32).unwrap();
    ops::reduce_scatter_offset(&x, std::slice::from_ref(&out), &g, 0, None, None, ReduceOp::Sum).unwrap();
    assert_eq!(
        out.to_vec::<f32>().unwrap(),
        (me * rows / ws * cols..(me + 1) * rows / ws * cols).map(sum).collect::<Vec<_>>()
    );
    assert!(ops::reduce_scatter_offset(&x, &[], &g, 2, None, None, ReduceOp::Sum).is_err());
    // all_to_all_nd, both pairs, 2-D and 3-D outputs.
    let (lc, lr) = (cols / ws, rows / ws);
    for three_d in [false, true] {
        let o = if three_d {
            Tensor::zeros(&[ws, rows, lc], DType::F32)
        } else {
            Tensor::zeros(&[ws * rows, lc], DType::F32)
        }
        .unwrap();
        ops::all_to_all_nd(&x, &o, 1, 0, &g).unwrap();
        let want: Vec<f32> = (0..ws)
            .flat_map(|j| (0..rows).flat_map(move |r| (0..lc).map(move |c| val(j, r * cols + me * lc + c))))
            .collect();
        assert_eq!(o.to_vec::<f32>().unwrap(), want, "all_to_all_nd (1, 0)");
        let o = if three_d {
            Tensor::zeros(&[lr, ws, cols], DType::F32)
        } else {
            Tensor::zeros(&[lr, ws * cols], DType::F32)
        }
        .unwrap();
        ops::all_to_all_nd(&x, &o, 0, 1, &g).unwrap();
        let want: Vec<f32> = (0..lr)
            .flat_map(|r| (0..ws).flat_map(move |j| (0..cols).map(move |c| val(j, (me * lr + r) * cols + c))))
            .collect();
        assert_eq!(o.to_vec::<f32>().unwrap(), want, "all_to_all_nd (0, 1)");
    }
    // 3-D input view of the same memory.
    let x3 = x.view(&[rows, ws, lc]).unwrap();
    let o = Tensor::zeros(&[ws, rows, lc], DType::F32).unwrap();
    ops::all_to_all_nd(&x3, &o, 1, 0, &g).unwrap();
    assert!(ops::all_to_all_nd(&x, &o, 1, 1, &g).is_err());
    g.barrier(std::time::Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn offset_reductions_and_nd_exchanges_match_the_reference() {
    for n in [2, 3, 4, 8] {
        job(n, "rank_nd");
    }
}

/// C = A @ B in f64, row-major.
fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

#[test]
#[ignore = "a rank program; run by fused_matmuls_match_matmul_over_the_gathered_input"]
fn rank_matmul() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, ws) = (g.rank(), g.world_size());
    let (m, k, n) = (4, 6, 5);
    let a_val = |r: usize, i: usize| ((i * 5 + r * 3) % 7) as f64 - 3.0;
    let b_val = |t: usize, i: usize| ((i * 3 + t) % 5) as f64 - 2.0;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for gather_dim in [0usize, 1] {
            let a = symm::empty(&[m, k], dtype, Device::Cpu).unwrap();
            tensor_of(dtype, &a, &(0..m * k).map(|i| a_val(me, i) as i64).collect::<Vec<_>>());
            let kk = if gather_dim == 1 { k * ws } else { k };
            let bs: Vec<Tensor> = (0..2)
                .map(|t| {
                    let b = Tensor::zeros(&[kk, n + t], dtype).unwrap();
                    tensor_of(dtype, &b, &(0..kk * (n + t)).map(|i| b_val(t, i) as i64).collect::<Vec<_>>());
                    b
                })
                .collect();
            let (gathered, outs) = ops::fused_all_gather_matmul(&a, &bs, gather_dim, &g, true).unwrap();
            // The reference: gather on the host, then multiply.
            let full: Vec<f64> = if gather_dim == 0 {
                (0..ws).flat_map(|r| (0..m * k).map(move |i| a_val(r, i))).collect()
            } else {
                (0..m).flat_map(|row| (0..ws).flat_map(move |r| (0..k).map(move |c| a_val(r, row * k + c)))).collect()
            };
            let rows = if gather_dim == 0 { m * ws } else { m };
            assert_eq!(values(gathered.as_ref().unwrap()), full, "gathered A ({dtype}, dim {gather_dim})");
            for (t, out) in outs.iter().enumerate() {
                let b: Vec<f64> = (0..kk * (n + t)).map(|i| b_val(t, i)).collect();
                let want = matmul(&full, &b, rows, kk, n + t);
                let got = values(out);
                for (x, y) in got.iter().zip(&want) {
                    assert!(close(*x, *y, dtype), "fused_all_gather_matmul {dtype} dim {gather_dim}: {x} vs {y}");
                }
                agree(&g, &format!("agmm-{dtype}-{gather_dim}-{t}"), out);
            }
            let (none, _) = ops::fused_all_gather_matmul(&a, &bs, gather_dim, &g, false).unwrap();
            assert!(none.is_none());
        }
        // fused_matmul_reduce_scatter: Σ_r A_r @ B_r, block `me`.
        let (mm, kk2, nn) = (ws * 2, 3, ws * 3);
        let a = Tensor::zeros(&[mm, kk2], dtype).unwrap();
        tensor_of(dtype, &a, &(0..mm * kk2).map(|i| a_val(me, i) as i64).collect::<Vec<_>>());
        let b = Tensor::zeros(&[kk2, nn], dtype).unwrap();
        tensor_of(dtype, &b, &(0..kk2 * nn).map(|i| b_val(me, i) as i64).collect::<Vec<_>>());
        let mut total = vec![0.0; mm * nn];
        for r in 0..ws {
            let ar: Vec<f64> = (0..mm * kk2).map(|i| a_val(r, i)).collect();
            let br: Vec<f64> = (0..kk2 * nn).map(|i| b_val(r, i)).collect();
            for (t, x) in total.iter_mut().zip(matmul(&ar, &br, mm, kk2, nn)) {
                *t += x;
            }
        }
        for (op, div) in [(ReduceOp::Sum, 1.0), (ReduceOp::Avg, ws as f64)] {
            for scatter_dim in [0usize, 1] {
                let out = ops::fused_matmul_reduce_scatter(&a, &b, op, scatter_dim, &g).unwrap();
                let got = values(&out);
                let want: Vec<f64> = if scatter_dim == 0 {
                    (me * 2 * nn..(me + 1) * 2 * nn).map(|i| total[i] / div).collect()
                } else {
                    (0..mm)
                        .flat_map(|row| (me * 3..me * 3 + 3).map(move |c| row * nn + c))
                        .map(|i| total[i] / div)
                        .collect()
                };
                for (x, y) in got.iter().zip(&want) {
                    assert!(
                        close(*x, *y, dtype),
                        "fused_matmul_reduce_scatter {dtype} {op:?} dim {scatter_dim}: {x} vs {y}"
                    );
                }
            }
        }
    }
    let a = symm::empty(&[4], DType::F32, Device::Cpu).unwrap();
    assert!(
        ops::fused_all_gather_matmul(&a, &[], 0, &g, true)
            .unwrap_err()
            .to_string()
            .contains("A_shard must be a matrix")
    );
    g.barrier(std::time::Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn fused_matmuls_match_matmul_over_the_gathered_input() {
    for n in [2, 3, 4, 8] {
        job(n, "rank_matmul");
    }
}

#[test]
#[ignore = "a rank program; run by every_dtype_moves_and_tiles"]
fn rank_dtypes() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, ws) = (g.rank(), g.world_size());
    let (cap, cols) = (16usize, 2usize);
    let v = |src: usize, i: usize| ((src * 7 + i * 3) % 19) as i64 - 9;
    for dtype in REDUCIBLE {
        let val = |src: usize, i: usize| if signed(dtype) { v(src, i) } else { v(src, i) + 9 };
        // all_to_all_vdev moves rows of any dtype untouched.
        let input = symm::empty(&[cap, cols], dtype, Device::Cpu).unwrap();
        tensor_of(dtype, &input, &(0..cap * cols).map(|i| val(me, i)).collect::<Vec<_>>());
        let split = |src: usize, dst: usize| ((src + 2 * dst) % 3) as i64;
        let in_splits = i64_symm(&(0..ws).map(|d| split(me, d)).collect::<Vec<_>>(), &[ws]);
        let out = Tensor::zeros(&[cap * ws, cols], dtype).unwrap();
        let oso = Tensor::zeros(&[2, ws], DType::I64).unwrap();
        ops::all_to_all_vdev(&input, &out, &in_splits, &oso, &g).unwrap();
        let got = values(&out);
        let mut at = 0;
        for src in 0..ws {
            let first: i64 = (0..me).map(|d| split(src, d)).sum();
            for r in 0..split(src, me) as usize {
                for c in 0..cols {
                    assert_eq!(
                        got[(at + r) * cols + c],
                        val(src, (first as usize + r) * cols + c) as f64,
                        "a2av {dtype}"
                    );
                }
            }
            at += split(src, me) as usize;
        }
        // 2d dispatch + combine round trip in this dtype.
        let ne = 2;
        let s2: Vec<i64> = (0..ws * ne).map(|i| ((me + i) % 3) as i64).collect();
        let total: i64 = s2.iter().sum();
        let in2 = i64_symm(&s2, &[ws * ne]);
        let mid = symm::empty(&[cap * ws, cols], dtype, Device::Cpu).unwrap();
        let mid_so = symm::empty(&[2, ws * ne], DType::I64, Device::Cpu).unwrap();
        ops::all_to_all_vdev_2d(&input, &mid, &in2, &mid_so, &g, Some(2)).unwrap();
        let back = Tensor::zeros(&[cap, cols], dtype).unwrap();
        let back_so = Tensor::zeros(&[2, ws * ne], DType::I64).unwrap();
        ops::all_to_all_vdev_2d_offset(&mid, &back, &mid_so, &back_so, &g).unwrap();
        let k = total as usize * cols;
        assert_eq!(values(&back)[..k], values(&input)[..k], "2d round trip {dtype}");
        // tile_reduce of a strided quadrant in this dtype.
        let full = symm::empty(&[6, 6], dtype, Device::Cpu).unwrap();
        tensor_of(dtype, &full, &(0..36).map(|i| val(me, i)).collect::<Vec<_>>());
        let quad = full.tile(1..4, 2..5).unwrap();
        let out_tile = Tensor::zeros(&[3, 3], dtype).unwrap();
        ops::tile_reduce(&quad, &out_tile, 0, &g, ReduceOp::Sum).unwrap();
        if me == 0 {
            let want: Vec<f64> = (1..4)
                .flat_map(|r| (2..5).map(move |c| r * 6 + c))
                .map(|i| (0..ws).map(|s| val(s, i)).sum::<i64>() as f64)
                .collect();
            assert_eq!(values(&out_tile), want, "tile_reduce {dtype}");
        }
    }
    // reduce_scatter_offset and all_to_all_nd in every dtype.
    for dtype in REDUCIBLE {
        let val = |src: usize, i: usize| if signed(dtype) { v(src, i) } else { v(src, i) + 9 };
        let (rows, cols) = (ws * 2, ws * 2);
        let x = symm::empty(&[rows, cols], dtype, Device::Cpu).unwrap();
        tensor_of(dtype, &x, &(0..rows * cols).map(|i| val(me, i)).collect::<Vec<_>>());
        let out = Tensor::zeros(&[rows, 2], dtype).unwrap();
        ops::reduce_scatter_offset(&x, std::slice::from_ref(&out), &g, 1, None, None, ReduceOp::Max).unwrap();
        let want: Vec<f64> = (0..rows)
            .flat_map(|r| (me * 2..me * 2 + 2).map(move |c| r * cols + c))
            .map(|i| (0..ws).map(|s| val(s, i)).max().unwrap() as f64)
            .collect();
        assert_eq!(values(&out), want, "reduce_scatter_offset {dtype}");
        let o = Tensor::zeros(&[ws, rows, 2], dtype).unwrap();
        ops::all_to_all_nd(&x, &o, 1, 0, &g).unwrap();
        let want: Vec<f64> = (0..ws)
            .flat_map(|j| (0..rows).flat_map(move |r| (0..2).map(move |c| (j, r * cols + me * 2 + c))))
            .map(|(j, i)| val(j, i) as f64)
            .collect();
        assert_eq!(values(&o), want, "all_to_all_nd {dtype}");
    }
    // Booleans move through the data-movement operators.
    let b = symm::empty(&[ws * 4], DType::Bool, Device::Cpu).unwrap();
    b.copy_from_slice(&(0..ws * 4).map(|i| u8::from((i + me) % 2 == 0)).collect::<Vec<_>>()).unwrap();
    let gathered = Tensor::zeros(&[ws * ws * 4], DType::Bool).unwrap();
    ops::all_gather_into(&b, &g, &gathered).unwrap();
    let want: Vec<u8> = (0..ws).flat_map(|r| (0..ws * 4).map(move |i| u8::from((i + r) % 2 == 0))).collect();
    assert_eq!(gathered.to_vec::<u8>().unwrap(), want, "all_gather bool");
    let swapped = Tensor::zeros(&[ws * 4], DType::Bool).unwrap();
    ops::all_to_all(&b, &swapped, &g).unwrap();
    let want: Vec<u8> = (0..ws).flat_map(|j| (0..4).map(move |k| u8::from((me * 4 + k + j) % 2 == 0))).collect();
    assert_eq!(swapped.to_vec::<u8>().unwrap(), want, "all_to_all bool");
    assert!(ops::one_shot_all_reduce(&b, ReduceOp::Sum, &g).is_err(), "bool cannot be reduced");
    g.barrier(std::time::Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn every_dtype_moves_and_tiles() {
    for n in [2, 3, 4] {
        job(n, "rank_dtypes");
    }
}
