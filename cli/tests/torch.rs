//! Interoperability with PyTorch's TCPStore, both ways, and with torchrun, against a real
//! torch 2.15 install. The tests need `SYMMEM_TORCH_PYTHON` (a Python with torch; `.ci/run`
//! provides one) and say SKIPPED without it.

#![allow(clippy::print_stderr, clippy::print_stdout, reason = "skip notices and rank output")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use symmem::store::{ClientOptions, Secret, ServerOptions, Store, StoreServer, TcpStore};

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_symmem");

fn python() -> Option<String> {
    let py = std::env::var("SYMMEM_TORCH_PYTHON").ok()?;
    let ok = Command::new(&py).args(["-c", "import torch.distributed"]).output().is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

macro_rules! need_torch {
    () => {
        match python() {
            Some(p) => p,
            None => {
                eprintln!("SKIPPED: set SYMMEM_TORCH_PYTHON to a Python with torch 2.15 to run this test");
                return;
            }
        }
    };
}

fn script(name: &str) -> String {
    format!("{}/tests/torch/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A PyTorch TCPStore server (libuv or legacy); dropping the child's stdin stops it.
struct TorchServer {
    child: Child,
    port: u16,
}

impl TorchServer {
    fn start(py: &str, backend: &str) -> TorchServer {
        let mut child = Command::new(py)
            .arg(script("serve.py"))
            .arg(backend)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        TorchServer { port: line.trim().parse().unwrap(), child }
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        if let Some(mut i) = self.child.stdin.take() {
            let _ = i.write_all(b"");
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `name=value` lines of client_ops.py against `port`.
fn client_ops(py: &str, port: u16, extra: &[&str]) -> Vec<String> {
    let out = Command::new(py)
        .arg(script("client_ops.py"))
        .args(["127.0.0.1", &port.to_string()])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "client_ops failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text.lines().filter(|l| l.contains('=') && !l.starts_with('[')).map(str::to_string).collect()
}

#[test]
fn torch_clients_see_symmem_as_they_see_torchs_own_server() {
    let py = need_torch!();
    let theirs = TorchServer::start(&py, "libuv");
    let reference = client_ops(&py, theirs.port, &[]);
    assert!(reference.iter().any(|l| l == "done=True"), "{reference:?}");
    let ours = StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap();
    let got = client_ops(&py, ours.local_addr().port(), &[]);
    assert_eq!(got, reference, "a torch client gets the same answers from symmem's server");
    // The legacy server agrees too, for what it implements.
    let legacy = TorchServer::start(&py, "legacy");
    let ours2 = StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap();
    assert_eq!(
        client_ops(&py, ours2.local_addr().port(), &["--no-queues"]),
        client_ops(&py, legacy.port, &["--no-queues"])
    );
}

fn every_operation(store: &dyn Store) {
    store.set("k1", b"v1").unwrap();
    assert_eq!(store.get("k1").unwrap(), b"v1");
    assert_eq!(store.add("cnt", 7).unwrap(), 7);
    assert_eq!(store.add("cnt", -10).unwrap(), -3);
    assert_eq!(store.get("cnt").unwrap(), b"-3");
    assert_eq!(store.compare_set("cs", b"x", b"y").unwrap(), b"x");
    assert_eq!(store.compare_set("cs", b"", b"first").unwrap(), b"first");
    assert_eq!(store.compare_set("cs", b"nope", b"second").unwrap(), b"first");
    assert_eq!(store.compare_set("cs", b"first", b"second").unwrap(), b"second");
    assert!(store.check(&["k1", "cnt"]).unwrap());
    assert!(!store.check(&["k1", "missing"]).unwrap());
    assert!(store.check(&[]).unwrap());
    store.append("log", b"ab").unwrap();
    store.append("log", b"cd").unwrap();
    assert_eq!(store.get("log").unwrap(), b"abcd");
    store.multi_set(&[("m1", b"1"), ("m2", b"22")]).unwrap();
    assert_eq!(store.multi_get(&["m2", "m1"]).unwrap(), vec![b"22".to_vec(), b"1".to_vec()]);
    assert_eq!(store.multi_get(&[]).unwrap(), Vec::<Vec<u8>>::new());
    let n = store.num_keys().unwrap();
    assert!(store.delete("m2").unwrap());
    assert!(!store.delete("m2").unwrap());
    assert_eq!(store.num_keys().unwrap(), n - 1);
    for _ in 0..3 {
        assert!(store.wait_timeout(&["never"], Duration::from_millis(100)).unwrap_err().is_timeout());
        assert_eq!(store.get("k1").unwrap(), b"v1", "usable after a cancelled wait");
    }

    // A barrier member's arrival: delete, set and wait in one round trip.
    store.set("b/0/1", b"").unwrap();
    store.set("b/old", b"").unwrap();
    store.arrive_and_wait(&["b/old", "b/absent"], "b/0/0", &["b/0/0", "b/0/1"], Duration::from_secs(5)).unwrap();
    assert!(store.check(&["b/0/0"]).unwrap() && !store.check(&["b/old"]).unwrap());
    let err = store.arrive_and_wait(&[], "b/1/0", &["b/1/0", "b/1/1"], Duration::from_millis(100)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(store.check(&["b/1/0"]).unwrap(), "the arrival was set before the wait");
    assert_eq!(store.get("k1").unwrap(), b"v1", "usable after a timed-out arrival");
}

#[test]
fn symmem_clients_work_against_torchs_servers() {
    let py = need_torch!();
    for backend in ["libuv", "legacy"] {
        let server = TorchServer::start(&py, backend);
        let addr = format!("127.0.0.1:{}", server.port);
        let store = TcpStore::connect(&addr, ClientOptions { timeout: Duration::from_secs(20), secret: None }).unwrap();
        every_operation(&store);
        // symmem's group barrier (one pipelined request per rank) on torch's server.
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let store: std::sync::Arc<dyn Store> =
                        std::sync::Arc::new(TcpStore::connect(&addr, Default::default()).unwrap());
                    let g = symmem::Group::new(r, 3, store).unwrap();
                    for _ in 0..20 {
                        g.barrier(Duration::from_secs(20)).unwrap();
                    }
                })
            })
            .collect();
        ranks.into_iter().for_each(|r| r.join().unwrap());
        // Keys mean the same from both sides: a Rust set is a Python get.
        store.set("shared", b"from rust").unwrap();
        let out = Command::new(&py)
            .args(["-c", &format!(
                "import torch.distributed as d; s = d.TCPStore('127.0.0.1', {}, is_master=False); print(s.get('shared').decode()); s.set('back', 'from python')",
                server.port
            )])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("from rust"),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(store.get("back").unwrap(), b"from python", "{backend}");
        // A wait on a Rust client is woken by a Python set.
        let waiter = std::thread::spawn({
            let addr = addr.clone();
            move || {
                TcpStore::connect(&addr, Default::default())
                    .unwrap()
                    .get_timeout("py_late", Duration::from_secs(20))
                    .unwrap()
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        Command::new(&py)
            .args([
                "-c",
                &format!(
                    "import torch.distributed as d; d.TCPStore('127.0.0.1', {}, is_master=False).set('py_late', 'ok')",
                    server.port
                ),
            ])
            .output()
            .unwrap();
        assert_eq!(waiter.join().unwrap(), b"ok", "{backend}");
    }
}

#[test]
fn torch_ranks_run_gloo_under_symmem_run() {
    let py = need_torch!();
    let out = Command::new(BIN)
        .args(["run", "-n", "2", "--timeout", "120", "--"])
        .arg(&py)
        .arg(script("gloo.py"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..2 {
        assert!(text.contains(&format!("[{r}] rank {r} all_reduce=[3.0, 3.0]")), "{text}");
    }
}

/// Symmetric memory from Python under `symmem run` (the `symmem` package must be installed in
/// that Python: `python/test.sh`, which the README's test command runs first, installs it).
#[test]
fn python_symmetric_memory_runs_under_symmem_run() {
    let py = need_torch!();
    let has_pkg = Command::new(&py).args(["-c", "import symmem.symm"]).output().is_ok_and(|o| o.status.success());
    if !has_pkg {
        eprintln!("SKIPPED: the symmem Python package is not installed in {py} (run python/test.sh)");
        return;
    }
    let worker = format!("{}/../python/tests/symm_worker.py", env!("CARGO_MANIFEST_DIR"));
    let out =
        Command::new(BIN).args(["run", "-n", "3", "--timeout", "120", "--"]).arg(&py).arg(worker).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..3 {
        assert!(text.contains(&format!("[{r}] symm worker ok {r}")), "{text}");
    }
}

/// A Rust rank under torchrun: joins through torchrun's agent store as a client.
#[test]
#[ignore = "a rank program; run by rust_ranks_run_under_torchrun"]
fn torchrun_rank() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = symmem::Group::from_env().unwrap();
    let all = g.all_gather_bytes("hello", format!("rust rank {}", g.rank()).as_bytes()).unwrap();
    g.barrier(Duration::from_secs(30)).unwrap();
    println!(
        "rank {} saw {}",
        g.rank(),
        all.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect::<Vec<_>>().join(",")
    );
}

#[test]
fn rust_ranks_run_under_torchrun() {
    let py = need_torch!();
    // torchrun leaves a `torchelastic_*` log directory in the temporary directory: this test's own.
    let tmp = tempfile::tempdir().unwrap();
    // `python -m torch.distributed.run` is torchrun, without depending on the script's shebang.
    let out = Command::new(&py)
        .args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "torchrun_rank", "--include-ignored", "--nocapture"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    assert_eq!(text.matches("saw rust rank 0,rust rank 1").count(), 2, "{text}");
    // torchrun's store cannot be authenticated: each rank says so once, and what closes it.
    assert_eq!(err.matches("is not authenticated").count(), 2, "{err}");
    assert!(err.contains("SYMMEM_JOB_SECRET"), "{err}");
}

#[test]
fn an_authenticated_store_serves_torch_clients_of_its_user_on_its_host() {
    let py = need_torch!();
    let server =
        StoreServer::start("127.0.0.1:0", ServerOptions { secret: Secret::new("s3cret"), ..Default::default() })
            .unwrap();
    let port = server.local_addr().port().to_string();
    let out = Command::new(&py).arg(script("refused.py")).args(["127.0.0.1", &port]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ACCEPTED"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn an_authenticated_store_refuses_torch_clients_and_keeps_serving() {
    let py = need_torch!();
    // Trusting nobody without the secret, not even this user on this host (the default
    // trusts PyTorch clients of the store's user; see the next test).
    let options = ServerOptions { secret: Secret::new("s3cret"), trust_local_user: false, ..Default::default() };
    let server = StoreServer::start("127.0.0.1:0", options).unwrap();
    let port = server.local_addr().port().to_string();
    let t = std::time::Instant::now();
    let out = Command::new(&py).arg(script("refused.py")).args(["127.0.0.1", &port]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("REFUSED"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(t.elapsed() < Duration::from_secs(30));
    let ok = TcpStore::connect(
        &server.local_addr().to_string(),
        ClientOptions { secret: Secret::new("s3cret"), ..Default::default() },
    )
    .unwrap();
    ok.set("k", b"v").unwrap();
    assert_eq!(ok.get("k").unwrap(), b"v");
}

#[test]
fn a_pytorch_process_and_a_rust_process_pair_with_new_transport_rank() {
    let py = need_torch!();
    let has_backend =
        Command::new(&py).args(["-c", "import symmem.torch_backend"]).output().is_ok_and(|o| o.status.success());
    if !has_backend {
        eprintln!("SKIPPED: the symmem Python package is not installed in {py} (python/test.sh installs it)");
        return;
    }
    use std::sync::Arc;
    use symmem::tensor::{DType, Tensor};
    use symmem::transport::{Options, RemoteBuffer, new_transport_rank};
    let server = StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap();
    let port = server.local_addr().port();
    let child = Command::new(&py)
        .arg(script("transport_rank.py"))
        .arg(port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let store: Arc<dyn Store> =
        Arc::new(TcpStore::connect(&server.local_addr().to_string(), Default::default()).unwrap());
    // Rank 1 here, rank 0 in Python: PyTorch's key scheme on both sides.
    let t = new_transport_rank("symmem", None, &store, 0, 1, Duration::from_secs(30), &Options::new()).unwrap();
    let theirs = RemoteBuffer::deserialize(&store.get("py_src").unwrap()).unwrap();
    let inbox = RemoteBuffer::deserialize(&store.get("py_inbox").unwrap()).unwrap();
    let local = Tensor::zeros(&[1024], DType::F32).unwrap();
    let m = t.register_memory(&local).unwrap();
    t.read(&m.to_mutable_view(0, None).unwrap(), &theirs, None).unwrap();
    let got = local.to_vec::<f32>().unwrap();
    assert_eq!(got, (0..1024).map(|i| i as f32).collect::<Vec<_>>(), "read a PyTorch tensor");
    local.copy_from_slice(&got.iter().map(|v| v * 2.0).collect::<Vec<_>>()).unwrap();
    t.write(&m.to_view(0, None).unwrap(), &inbox, None).unwrap();
    store.set("rust_done", b"1").unwrap();
    store.get_timeout("py_done", Duration::from_secs(30)).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("PY OK"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    println!("{}", text.trim());
    t.close(None).unwrap();
}

/// README's "Run across hosts" with torchrun: two machines (network and UTS namespaces, each
/// its own hostname and address), one torchrun each pointing at the first, 2 ranks per host,
/// and no symmem setting but the job secret torchrun's store cannot carry.
#[test]
fn torchrun_on_two_machines_needs_no_symmem_settings() {
    let py = need_torch!();
    let has_pkg = Command::new(&py).args(["-c", "import symmem.symm"]).output().is_ok_and(|o| o.status.success());
    if !has_pkg {
        eprintln!("SKIPPED: the symmem Python package is not installed in {py} (run python/test.sh)");
        return;
    }
    let hosts = match common::Hosts::create(2) {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    // torchrun's `torchelastic_*` log directories go into this test's directory.
    let tmp = tempfile::tempdir().unwrap();
    let node = |i: usize| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.names[i], "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
            .arg(format!("machine{i}"))
            .arg(&py)
            .args(["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", &i.to_string()])
            .args(["--master-addr", "10.213.0.1", "--master-port", "29500", "--nproc-per-node", "2"])
            .arg(script("across_hosts.py"))
            .env("SYMMEM_JOB_SECRET", "a secret both machines share")
            .env("TMPDIR", tmp.path());
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if k.starts_with("SYMMEM_") && k != "SYMMEM_JOB_SECRET" {
                c.env_remove(k);
            }
        }
        c.output().unwrap()
    };
    let (a, b) = std::thread::scope(|s| {
        let b = s.spawn(|| node(1));
        (node(0), b.join().unwrap())
    });
    let text = format!("{}{}", String::from_utf8_lossy(&a.stdout), String::from_utf8_lossy(&b.stdout));
    let errs = format!("{}{}", String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
    assert!(a.status.success() && b.status.success(), "{text}\n{errs}");
    for r in 0..4 {
        assert!(text.contains(&format!("rank {r} of 4 sum 10.0")), "{text}\n{errs}");
    }
}

/// `symmem run` gives ranks what torchrun gives them (OMP_NUM_THREADS=1 when unset for several
/// ranks, ROLE_*, TORCHELASTIC_*, a per-rank error file) and records the root cause in the
/// launcher's own error file as torchrun does: run both, compare.
#[test]
fn run_matches_torchrun_on_environment_and_error_files() {
    let py = need_torch!();
    let dir = tempfile::tempdir().unwrap();
    let run = |launcher: &[&str], file: &std::path::Path| {
        let out = Command::new(launcher[0])
            .args(&launcher[1..])
            .arg(script("record_fail.py"))
            .env("TORCHELASTIC_ERROR_FILE", file)
            // torchrun's `torchelastic_*` log directory goes into this test's directory.
            .env("TMPDIR", dir.path())
            .env_remove("OMP_NUM_THREADS")
            .env_remove("SYMMEM_STORE_SECRET")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut env: Vec<String> =
            stdout.lines().filter_map(|l| l.split_once("env ").map(|(_, e)| e.to_string())).collect();
        env.sort();
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        (out.status.code(), env, json, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (theirs_file, ours_file) = (dir.path().join("torchrun.json"), dir.path().join("symmem.json"));
    let theirs = run(
        &[&py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python", &py],
        &theirs_file,
    );
    let ours = run(&[BIN, "run", "-n", "2", "--", &py], &ours_file);
    assert_eq!(ours.0, theirs.0, "exit codes");
    assert_eq!(ours.1, theirs.1, "the ranks' environment");
    assert_eq!(ours.1.len(), 2);
    assert!(ours.1[0].contains("OMP_NUM_THREADS=1") && ours.1[1].contains("ROLE_RANK=1"), "{:?}", ours.1);
    let keys = |j: &serde_json::Value| {
        let m = j["message"].as_object().unwrap();
        let mut k: Vec<String> = m.keys().cloned().collect();
        k.extend(m["extraInfo"].as_object().unwrap().keys().map(|k| format!("extraInfo.{k}")));
        k.sort();
        k
    };
    assert_eq!(keys(&ours.2), keys(&theirs.2), "the error file's fields");
    assert_eq!(ours.2["message"]["message"], theirs.2["message"]["message"]);
    assert_eq!(ours.2["message"]["errorCode"], theirs.2["message"]["errorCode"]);
    assert!(ours.2["message"]["extraInfo"]["py_callstack"].as_str().unwrap().contains("boom on rank 1"));
    assert!(ours.3.contains("OMP_NUM_THREADS=1") && ours.3.contains("root cause"), "{}", ours.3);
}
