//! Trust: what a stranger, a careless caller or a misbehaving peer can do to a job, one test
//! (or more) per finding of the adversarial review (issue 13). Each names its item.
//!
//! Rank programs (`rank_*`) are ignored in a normal run and started by the matching test as
//! every rank of a `symmem run` job.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "rank programs report through stdout")]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use symmem::ops;
use symmem::store::MemoryStore;
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};
use symmem::{Error, Group};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");

/// Runs rank program `scenario` on `n` ranks; returns (exit code, stdout + stderr).
fn job(n: usize, scenario: &str, env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(["run", "-n", &n.to_string(), "--timeout", "120", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", scenario, "--include-ignored", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// Runs `scenario` and checks that every rank finished it.
fn assert_job(n: usize, scenario: &str, env: &[(&str, &str)]) -> String {
    let (code, text) = job(n, scenario, env);
    assert_eq!(code, 0, "{scenario} on {n} ranks failed:\n{text}");
    for r in 0..n {
        let done = text.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.ends_with(&format!("rank {r} ok")));
        assert!(done, "rank {r} did not finish {scenario}:\n{text}");
    }
    text
}

fn in_job() -> Option<Group> {
    std::env::var("RANK").ok()?;
    Some(Group::from_env().unwrap())
}

fn i64_symm(vals: &[i64], shape: &[usize]) -> Tensor {
    let t = symm::empty(shape, DType::I64, Device::Cpu).unwrap();
    t.copy_from_slice(vals).unwrap();
    t
}

fn invalid(r: symmem::Result<()>, what: &str) -> String {
    match r {
        Err(e @ Error::InvalidArgument(_)) => e.to_string(),
        other => panic!("{what}: expected an invalid-argument error, got {other:?}"),
    }
}

// Item 4: all_to_all_vdev (and its 2-D variants) with splits whose sum wraps around i64 wrote
// before `out` on every rank. Now every rank refuses them, and the group stays usable.
#[test]
#[ignore = "a rank program; run by huge_splits_are_refused_on_every_rank"]
fn rank_huge_splits() {
    let Some(g) = in_job() else { return };
    let (me, ws) = (g.rank(), g.world_size());
    let input = symm::empty(&[8, 2], DType::F32, Device::Cpu).unwrap();
    let out = symm::empty(&[8 * ws, 2], DType::F32, Device::Cpu).unwrap();
    let oso = symm::empty(&[2, ws], DType::I64, Device::Cpu).unwrap();
    // i64::MAX + ... + 2 wraps to a negative sum, which passed "sum <= rows".
    let mut wrapping = vec![2i64; ws];
    wrapping[0] = i64::MAX;
    let splits = i64_symm(&wrapping, &[ws]);
    let e = invalid(ops::all_to_all_vdev(&input, &out, &splits, &oso, &g), "all_to_all_vdev");
    assert!(e.contains("rank 0's splits"), "every rank names the same offender: {e}");

    // 2-D dispatch: one expert per rank, the same wrapping splits.
    let oso2 = symm::empty(&[2, ws], DType::I64, Device::Cpu).unwrap();
    let e = invalid(ops::all_to_all_vdev_2d(&input, &out, &splits, &oso2, &g, None), "2d");
    assert!(e.contains("splits"), "{e}");
    let e = invalid(ops::all_to_all_vdev_2d(&input, &out, &splits, &oso2, &g, Some(usize::MAX)), "2d align");
    assert!(e.contains("major_align"), "{e}");
    // Legal splits whose padded segments overflow i64 through the alignment.
    let ones = i64_symm(&vec![1; ws], &[ws]);
    let huge_align = Some(i64::MAX as usize);
    let e = invalid(ops::all_to_all_vdev_2d(&input, &out, &ones, &oso2, &g, huge_align), "2d padding");
    assert!(e.contains("rows (with padding)"), "{e}");

    // 2-D combine: an offset whose end wraps.
    let mut so = vec![0i64; 2 * ws];
    for dst in 0..ws {
        so[dst] = 2;
        so[ws + dst] = i64::MAX - 1;
    }
    let in_so = i64_symm(&so, &[2, ws]);
    let back_so = symm::empty(&[2, ws], DType::I64, Device::Cpu).unwrap();
    let e = invalid(ops::all_to_all_vdev_2d_offset(&input, &out, &in_so, &back_so, &g), "2d_offset");
    assert!(e.contains("is outside its input"), "{e}");

    // The group is still usable: a correct exchange goes through.
    input.copy_from_slice(&(0..16).map(|i| (me * 100 + i) as f32).collect::<Vec<_>>()).unwrap();
    ops::all_to_all_vdev(&input, &out, &ones, &oso, &g).unwrap();
    let got = out.to_vec::<f32>().unwrap();
    for src in 0..ws {
        assert_eq!(got[src * 2], (src * 100 + me * 2) as f32, "row from rank {src}");
    }
    g.barrier(Duration::from_secs(30)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn huge_splits_are_refused_on_every_rank() {
    assert_job(2, "rank_huge_splits", &[]);
    assert_job(3, "rank_huge_splits", &[]);
}

// Item 5: get_buffer with a huge storage offset wrapped around and returned memory outside the
// peer's buffer; the tensor's extent computation wrapped the same way.
#[test]
fn huge_offsets_and_strides_are_refused() {
    let g = Group::new(0, 1, Arc::new(MemoryStore::new())).unwrap();
    let x = symm::empty(&[64], DType::F32, Device::Cpu).unwrap();
    let h = symm::rendezvous(&x, &g).unwrap();
    // storage_offset · 4 wraps to 0 when computed unchecked.
    for offset in [usize::MAX / 4 + 1, usize::MAX / 2, usize::MAX] {
        let e = h.get_buffer(0, &[4], DType::F32, offset).unwrap_err().to_string();
        assert!(e.contains("exceeds the allocated size"), "{e}");
    }
    // sizes whose product wraps to something small.
    let e = h.get_buffer(0, &[1 << 32, 1 << 32, 2], DType::F32, 0).unwrap_err().to_string();
    assert!(e.contains("exceeds the allocated size"), "{e}");
    assert!(h.get_buffer(0, &[16], DType::F32, 48).is_ok(), "the last 16 elements are in bounds");
    assert!(h.get_buffer(0, &[16], DType::F32, 49).is_err());

    let bytes = Tensor::zeros(&[64], DType::U8).unwrap();
    // (2 - 1) · usize::MAX + 1 wraps to an extent of 0 bytes.
    for (shape, strides, offset) in [
        (vec![2], vec![usize::MAX], 0),
        (vec![2, 2], vec![usize::MAX / 2 + 1, 1], 0),
        (vec![0], vec![1], usize::MAX),
        (vec![1 << 40, 1 << 40], vec![0, 0], 0),
    ] {
        let e = bytes.reinterpret(DType::U8, &shape, &strides, offset).unwrap_err().to_string();
        let refused = ["overflows", "too large", "more elements", "needs"].iter().any(|w| e.contains(w));
        assert!(refused, "{e}");
    }
    let e = bytes.reinterpret(DType::F64, &[2], &[usize::MAX / 8], 0).unwrap_err().to_string();
    assert!(e.contains("overflows"), "{e}");
}

// Item 13: rendezvous waited for the store's 300 s whatever SYMMEM_OP_TIMEOUT said.
#[test]
#[ignore = "a rank program; run by rendezvous_waits_honour_the_operator_timeout"]
fn rank_rendezvous_timeout() {
    let Some(g) = in_job() else { return };
    let me = g.rank();
    if me == 1 {
        // Rank 0 never joins this rendezvous.
        let x = symm::empty(&[4], DType::F32, Device::Cpu).unwrap();
        let t = Instant::now();
        let e = symm::rendezvous(&x, &g).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(t.elapsed() < Duration::from_secs(20), "waited {:?}", t.elapsed());
        assert!(e.to_string().contains("rank(s) [0]"), "names the missing rank: {e}");
    }
    g.barrier(Duration::from_secs(60)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn rendezvous_waits_honour_the_operator_timeout() {
    assert_job(2, "rank_rendezvous_timeout", &[("SYMMEM_OP_TIMEOUT", "2")]);
}

// Item 15: every rendezvous left four keys in the store, forever.
#[test]
#[ignore = "a rank program; run by rendezvous_keys_do_not_accumulate"]
fn rank_many_rendezvous() {
    let Some(g) = in_job() else { return };
    let before = g.store().num_keys().unwrap();
    for _ in 0..300 {
        let x = symm::empty(&[4], DType::F32, Device::Cpu).unwrap();
        symm::rendezvous(&x, &g).unwrap();
    }
    g.barrier(Duration::from_secs(60)).unwrap();
    let after = g.store().num_keys().unwrap();
    assert!(after - before < 20, "300 rendezvous left {} keys", after - before);
    g.barrier(Duration::from_secs(60)).unwrap();
    println!("rank {} ok", g.rank());
}

#[test]
fn rendezvous_keys_do_not_accumulate() {
    assert_job(2, "rank_many_rendezvous", &[]);
    assert_job(3, "rank_many_rendezvous", &[("SYMMEM_RENDEZVOUS", "gather")]);
}

// Item 8: a descriptor with many keys took quadratic time (64k keys: 16.6 s), holding the
// caller (and, from Python, the GIL).
#[test]
fn descriptors_with_many_keys_are_refused_in_linear_time() {
    use symmem::transport::RemoteBuffer;
    // 64k distinct keys: invalid fields, found after one linear pass.
    let mut d = String::from(r#"{"version":1,"backend":"tcp","fields":{"#);
    for i in 0..65_536 {
        d.push_str(&format!("\"k{i:05}\":0,"));
    }
    d.push_str(r#""z":0}}"#);
    assert!(d.len() < 1 << 20);
    let t = Instant::now();
    let e = RemoteBuffer::deserialize(d.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("invalid descriptor fields"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "64k keys took {:?}", t.elapsed());
    // A duplicate deep inside is still found.
    let dup = d.replace(r#""z":0}}"#, r#""k00007":1}}"#);
    let e = RemoteBuffer::deserialize(dup.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("duplicate descriptor field \"k00007\""), "{e}");
    // Megabytes are refused before parsing.
    let huge = format!("{{\"version\":1,\"backend\":\"tcp\",\"fields\":{{\"pad\":\"{}\"}}}}", "A".repeat(4 << 20));
    let t = Instant::now();
    let e = RemoteBuffer::deserialize(huge.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("exceeds the limit"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1));
}

/// This process's memory files whose name starts with `prefix`: (fd path, name).
fn memfds(prefix: &str) -> Vec<(std::path::PathBuf, String)> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let target = std::fs::read_link(&path).ok()?.to_string_lossy().into_owned();
            let name = target.strip_prefix("/memfd:")?.to_string();
            name.starts_with(prefix).then_some((path, name))
        })
        .collect()
}

// Item 15: memory files were created with mode 0777.
#[test]
fn memory_files_are_private_to_their_user() {
    use std::os::unix::fs::PermissionsExt;
    let _a = symm::empty(&[1024], DType::F32, Device::Cpu).unwrap();
    let _b = symmem::transport::shm::alloc(&[1024], DType::U8).unwrap();
    let files = memfds("symmem");
    assert!(files.len() >= 2, "{files:?}");
    for (path, name) in files {
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{name} has mode {mode:o}");
    }
}

// Item 12: a peer could kill its partner with SIGBUS by truncating its memory file (the shm
// transport's and symmetric segments alike). Now the files are sealed: truncation fails, and a
// reader keeps reading.
#[test]
#[ignore = "a rank program; run by a_peer_cannot_truncate_shared_memory_under_its_partner"]
fn rank_truncate() {
    let Some(g) = in_job() else { return };
    let me = g.rank();
    let t = Duration::from_secs(30);
    let x = symm::empty(&[1 << 20], DType::U8, Device::Cpu).unwrap();
    x.fill(7u8).unwrap();
    let h = symm::rendezvous(&x, &g).unwrap();
    h.barrier(0, t).unwrap();
    if me == 1 {
        // The attacker: cut every shared-memory file it owns to nothing.
        for (path, name) in memfds("symmem") {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let e = f.set_len(0).expect_err(&format!("truncating {name} must be refused"));
            assert_eq!(e.raw_os_error(), Some(1), "EPERM for {name}: {e}");
        }
    }
    h.barrier(0, t).unwrap();
    if me == 0 {
        // The victim reads the attacker's last page.
        let tail = h.get_buffer(1, &[4096], DType::U8, (1 << 20) - 4096).unwrap();
        assert!(tail.to_vec::<u8>().unwrap().iter().all(|&b| b == 7));
    }
    h.barrier(0, t).unwrap();
    println!("rank {me} ok");
}

#[test]
fn a_peer_cannot_truncate_shared_memory_under_its_partner() {
    assert_job(2, "rank_truncate", &[]);
}

/// How many mappings of memory files named `name` this process has.
fn mapped(name: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains(name)).count()
}

// Item 11: shm initiators never unmapped a peer's withdrawn registrations (10,000 cycles left
// 10,000 mappings; ~65k made writes fail with ENOMEM).
#[test]
fn withdrawn_shm_registrations_are_unmapped_by_their_peer() {
    use symmem::transport::{Options, new_transport, shm};
    let a = new_transport("shm", None, &Options::new()).unwrap();
    let b = new_transport("shm", None, &Options::new()).unwrap();
    let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
    a.connect(&ub, None).unwrap();
    b.connect(&ua, None).unwrap();
    let src = Tensor::from_slice(&[64], &[3u8; 64]).unwrap();
    let view = a.register_memory(&src).unwrap().to_view(0, None).unwrap();
    let name = "memfd:symmem-shm-tensor";
    // Register, write, unregister, free: the writer's mappings do not pile up.
    for _ in 0..300 {
        let t = shm::alloc(&[64], DType::U8).unwrap();
        let m = b.register_memory(&t).unwrap();
        a.write(&view, &m.to_remote_buffer().unwrap(), None).unwrap();
        assert_eq!(t.to_vec::<u8>().unwrap(), vec![3u8; 64]);
        b.unregister_memory(&m).unwrap();
    }
    assert!(mapped(name) <= 2, "{} mappings after 300 cycles", mapped(name));
    // Withdrawn while the writer is idle: freed within a few reaper periods.
    let held: Vec<_> = (0..16)
        .map(|_| {
            let t = shm::alloc(&[1 << 20], DType::U8).unwrap();
            let m = b.register_memory(&t).unwrap();
            let small = m.to_remote_buffer().unwrap().slice(0, 64).unwrap();
            a.write(&view, &small, None).unwrap();
            (t, m)
        })
        .collect();
    assert!(mapped(name) >= 32, "the owner's and the writer's mappings: {}", mapped(name));
    for (_, m) in &held {
        b.unregister_memory(m).unwrap();
    }
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    while mapped(name) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(mapped(name), 0, "the idle writer still maps withdrawn memory");
    a.close(None).unwrap();
    b.close(None).unwrap();
}

/// Whether process `pid` exists (a zombie counts).
fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Tries to start `setsid sleep 60` as process `pid` (through ns_last_pid, as CRIU restores
/// pids): the leader of a process group whose id is `pid`. None if `pid` stays taken.
fn impostor(pid: u32) -> Option<std::process::Child> {
    for _ in 0..200 {
        if std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_err() {
            return None;
        }
        let mut c = Command::new("setsid").args(["sleep", "60"]).spawn().ok()?;
        if c.id() == pid {
            return Some(c);
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    None
}

// Item 10: at exit the launcher signalled the process group of every rank, including ranks it
// had reaped long before, so an unrelated process that reused the pid was killed.
#[test]
fn the_launcher_never_signals_a_process_group_it_no_longer_owns() {
    use std::io::BufRead;
    if std::fs::OpenOptions::new().write(true).open("/proc/sys/kernel/ns_last_pid").is_err() {
        eprintln!(
            "SKIPPED: cannot write /proc/sys/kernel/ns_last_pid (not root), so a pid cannot be reused on purpose"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    // Rank 0 ends at once; rank 1 fails once told to, making the launcher stop the job.
    let script = format!(
        "if [ $RANK = 0 ]; then echo group $PPID; exit 0; fi; \
         for i in $(seq 300); do [ -e {go} ] && exit 3; sleep 0.1; done; exit 4",
        go = go.display()
    );
    let mut launcher = Command::new(BIN)
        .args(["run", "-n", "2", "--timeout", "60", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(launcher.stdout.take().unwrap()).lines();
    // The guard of rank 0 (its $PPID) leads rank 0's process group.
    let group: u32 = loop {
        let line = lines.next().expect("rank 0 reports its group").unwrap();
        if let Some(g) = line.strip_prefix("[0] group ") {
            break g.trim().parse().unwrap();
        }
    };
    // Rank 0 has ended by now; its launcher may have reaped it.
    std::thread::sleep(Duration::from_millis(500));
    let mut squatter = impostor(group);
    std::fs::write(&go, b"").unwrap();
    let status = launcher.wait().unwrap();
    assert_eq!(status.code(), Some(3), "rank 1's failure ends the job");
    if let Some(s) = &mut squatter {
        let alive = s.try_wait().unwrap().is_none();
        let _ = s.kill();
        let _ = s.wait();
        assert!(alive, "the launcher killed an unrelated process that reused rank 0's pid {group}");
    }
    assert!(!exists(group), "rank 0's guard {group} outlived the launcher");
}
