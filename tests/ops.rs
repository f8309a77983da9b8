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

                if n % (ws * (4 / dtype.size()).max(1)) == 0 {
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
