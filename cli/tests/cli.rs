//! The `symmem` command end to end: the launcher's contract (output, exit codes, failure,
//! signals, no orphans), the demo, the standalone store, info and the store benchmark.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");

fn symmem(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env_remove("SYMMEM_STORE_SECRET").output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Whether a process is still running (a zombie counts as gone: it runs nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit(')').next().and_then(|s| s.split_whitespace().next()) != Some("Z"),
        Err(_) => false,
    }
}

/// The pids each rank wrote into `dir` (a file per pid).
fn pids_in(dir: &Path) -> Vec<u32> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn assert_all_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left running: {left:?}");
}

#[test]
fn run_sets_the_torchrun_variables_and_prefixes_output() {
    let script =
        "echo $RANK/$WORLD_SIZE $ROLE_RANK/$ROLE_WORLD_SIZE $ROLE_NAME $OMP_NUM_THREADS; echo err$LOCAL_RANK >&2";
    let out = Command::new(BIN)
        .args(["run", "-n", "4", "--", "sh", "-c", script])
        .env_remove("SYMMEM_STORE_SECRET")
        .env("OMP_NUM_THREADS", "3")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    lines.sort();
    assert_eq!(
        lines,
        ["[0] 0/4 0/4 default 3", "[1] 1/4 1/4 default 3", "[2] 2/4 2/4 default 3", "[3] 3/4 3/4 default 3"]
    );
    let mut errs: Vec<String> = text(&out.stderr).lines().map(str::to_string).collect();
    errs.sort();
    assert_eq!(errs, vec!["[0] err0", "[1] err1", "[2] err2", "[3] err3"]);

    let out = symmem(&[
        "run",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo $LOCAL_WORLD_SIZE $MASTER_ADDR $TORCHELASTIC_USE_AGENT_STORE ${MASTER_PORT:+port}",
    ]);
    assert_eq!(text(&out.stdout).lines().filter(|l| l.ends_with("2 127.0.0.1 True port")).count(), 2);
}

/// The CPUs a `Cpus_allowed_list` value names (`0-3,6`).
fn cpu_list(s: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()),
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus
}

/// The CPUs each rank of `symmem run -n N [args]` may use, by rank.
fn ranks_cpus(n: usize, args: &[&str]) -> Vec<Vec<usize>> {
    let n_arg = n.to_string();
    let mut all = vec!["run", "-n", &n_arg];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", "grep Cpus_allowed_list /proc/self/status"]);
    let out = symmem(&all);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut by_rank = vec![None; n];
    for line in text(&out.stdout).lines() {
        let (rank, list) = line.split_once("] Cpus_allowed_list:").unwrap_or_else(|| panic!("{line}"));
        by_rank[rank.trim_start_matches('[').parse::<usize>().unwrap()] = Some(cpu_list(list));
    }
    by_rank.into_iter().map(|c| c.expect("every rank reports")).collect()
}

#[test]
fn run_bind_cores_gives_each_rank_cpus_of_its_own() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let mine = cpu_list(status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap());
    let m = mine.len();
    // Unbound (the default, and `none`): every rank may use every CPU the launcher may.
    for args in [&[][..], &["--bind", "none"]] {
        assert!(ranks_cpus(2, args).iter().all(|c| *c == mine), "{args:?}");
    }
    for n in [2, 3, m + 1] {
        let got = ranks_cpus(n, &["--bind", "cores"]);
        assert!(got.iter().all(|c| !c.is_empty() && c.iter().all(|x| mine.contains(x))), "{n} ranks: {got:?}");
        if n <= m {
            // Disjoint blocks of neighbours, sizes within one of each other, covering them all.
            let mut union: Vec<usize> = got.concat();
            union.sort_unstable();
            assert_eq!(union, mine, "{n} ranks: {got:?}");
            let sizes: Vec<usize> = got.iter().map(Vec::len).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{n} ranks: {got:?}");
        } else {
            // More ranks than CPUs: a CPU each, taken round.
            assert!((0..n).all(|r| got[r] == [mine[r % m]]), "{n} ranks on {m} CPUs: {got:?}");
        }
    }
    // Played hosts (launchers sharing the machine) split its CPUs among all their ranks: 2
    // hosts of a rank each, bound, get the shares of ranks 0 and 1, not both rank 0's.
    let dir = tempfile::tempdir().unwrap();
    let script = format!("grep Cpus_allowed_list /proc/self/status > {}/$RANK", dir.path().display());
    let mut o = symmem::launch::LaunchOptions::local(1, "sh", vec!["-c".into(), script.into()]);
    o.bind = symmem::launch::Bind::Cores;
    assert_eq!(symmem::launch::run_hosts(&o, 2).unwrap(), symmem::launch::Outcome::Success);
    let played: Vec<Vec<usize>> = (0..2)
        .map(|r| {
            let line = std::fs::read_to_string(dir.path().join(r.to_string())).unwrap();
            cpu_list(line.trim_start_matches("Cpus_allowed_list:"))
        })
        .collect();
    assert_eq!(played, ranks_cpus(2, &["--bind", "cores"]), "2 played hosts of a rank each");
    // Only the values it knows.
    let out = symmem(&["run", "-n", "2", "--bind", "sockets", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--bind"), "{}", text(&out.stderr));
}

#[test]
fn a_failing_rank_stops_the_job_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let script =
        format!("echo $$ > {}/$RANK; if [ $RANK = 1 ]; then sleep 0.3; exit 3; fi; sleep 30", dir.path().display());
    let t = Instant::now();
    let out = symmem(&["run", "-n", "3", "--", "sh", "-c", &script]);
    let took = t.elapsed();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(took < Duration::from_secs(2) + Duration::from_millis(300), "took {took:?}");
    let err = text(&out.stderr);
    assert!(err.contains("rank 1 exited with code 3"), "{err}");
    let pids = pids_in(dir.path());
    assert_eq!(pids.len(), 3);
    assert_all_gone(&pids);
}

#[test]
fn a_rank_killed_by_sigkill_stops_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!("echo $$ > {}/$RANK; sleep 30; true", dir.path().display());
    let child = Command::new(BIN)
        .args(["run", "-n", "3", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let victim = dir.path().join("2");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_in(dir.path()).len() < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid: i32 = std::fs::read_to_string(victim).unwrap().trim().parse().unwrap();
    let t = Instant::now();
    Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    assert_eq!(out.status.code(), Some(128 + 9));
    assert!(text(&out.stderr).contains("rank 2 was killed by signal 9 (SIGKILL)"), "{}", text(&out.stderr));
    // The ranks' own children (the sleeps) must be gone too.
    let out = Command::new("pgrep").args(["-f", &format!("echo \\$\\$ > {}", dir.path().display())]).output().unwrap();
    assert!(text(&out.stdout).trim().is_empty(), "left: {}", text(&out.stdout));
    assert_all_gone(&pids_in(dir.path()));
}

#[test]
fn killing_the_launcher_with_sigkill_leaves_no_process() {
    let dir = tempfile::tempdir().unwrap();
    // Each rank records its own pid and its child's; neither may survive the launcher.
    let script = format!("sleep 30 & echo $! > {d}/child$RANK; echo $$ > {d}/$RANK; wait", d = dir.path().display());
    let mut launcher = Command::new(BIN)
        .args(["run", "-n", "2", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_in(dir.path()).len() < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = pids_in(dir.path());
    assert_eq!(pids.len(), 4);
    launcher.kill().unwrap(); // SIGKILL
    launcher.wait().unwrap();
    assert_all_gone(&pids);
}

#[test]
fn a_launcher_killed_with_sigkill_leaves_no_files_behind_the_next_run() {
    let tmp = tempfile::tempdir().unwrap();
    let ranks = tempfile::tempdir().unwrap();
    let script = format!("echo $$ > {d}/$RANK; sleep 30", d = ranks.path().display());
    let mut launcher = Command::new(BIN)
        .args(["run", "-n", "2", "--", "sh", "-c", &script])
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_in(ranks.path()).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let folders: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(folders.len(), 1, "the launcher keeps its ranks' error files in one folder: {folders:?}");
    let dead = &folders[0];
    let name = dead.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("symmem-run-"), "{name}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dead).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the ranks' error files (tracebacks) are this user's only");
    launcher.kill().unwrap(); // SIGKILL: no chance to clean up
    launcher.wait().unwrap();
    assert_all_gone(&pids_in(ranks.path()));
    // The next launcher of this user sweeps the dead one's folder, and cleans its own.
    let out = Command::new(BIN).args(["run", "-n", "1", "--", "true"]).env("TMPDIR", tmp.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn sigterm_is_forwarded_to_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "trap 'echo got > {d}/term$RANK; exit 0' TERM; echo $$ > {d}/$RANK; while true; do sleep 0.05; done",
        d = dir.path().display()
    );
    let mut launcher = Command::new(BIN)
        .args(["run", "-n", "2", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_in(dir.path()).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    Command::new("kill").args(["-TERM", &launcher.id().to_string()]).status().unwrap();
    let status = launcher.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15));
    assert!(dir.path().join("term0").exists() && dir.path().join("term1").exists(), "the ranks saw SIGTERM");
}

#[test]
fn timeout_stops_the_job() {
    let t = Instant::now();
    let out = symmem(&["run", "-n", "2", "--timeout", "0.3", "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124));
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(text(&out.stderr).contains("longer than"), "{}", text(&out.stderr));
}

#[test]
fn a_missing_program_is_a_clear_error() {
    let out = symmem(&["run", "-n", "2", "--", "/nonexistent/program"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("/nonexistent/program"), "{err}");
    let out = symmem(&["run", "-n", "0", "--", "true"]);
    assert!(text(&out.stderr).contains("-n must be at least 1"), "{}", text(&out.stderr));
}

#[test]
fn ranks_rendezvous_through_the_launchers_store() {
    // The demo is a real multi-process job: ranks join through Group::from_env, all-gather
    // through the store and barrier.
    let out = symmem(&["demo", "-n", "3"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[0] rank 0: done: 3 ranks joined"), "{stdout}");
    assert!(stdout.contains("laps of a signal around the 3-rank ring"), "{stdout}");
    assert!(stdout.contains("all-reduce of 1 MiB (two-shot) on 3 ranks"), "{stdout}");
    assert!(stdout.contains("[1] rank 1: read rank 2's 4 KiB buffer directly"), "{stdout}");
    assert!(stdout.contains("[1] rank 1: replica verified all 4194304 weights"), "{stdout}");
    for r in 0..3 {
        assert!(stdout.contains(&format!("[{r}] rank {r}: 200 store barriers")), "{stdout}");
    }
    assert!(stdout.contains("2="), "all-gather lists every rank: {stdout}");
}

#[test]
fn the_demo_plays_two_hosts() {
    let out = symmem(&["demo", "--hosts", "2"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("playing 2 hosts"), "{stdout}");
    assert!(stdout.contains("ranks [2, 3] are on other hosts"), "{stdout}");
    assert!(stdout.contains("[1] rank 1: read rank 2's 4 KiB buffer one-sidedly from another host"), "{stdout}");
    assert!(stdout.contains("[2] rank 2: read rank 3's 4 KiB buffer directly (same host)"), "{stdout}");
    assert!(stdout.contains("all-reduce of 4 KiB (host-push) on 4 ranks"), "{stdout}");
    assert!(stdout.contains("all-reduce of 1 MiB (chain) on 4 ranks"), "{stdout}");
    assert!(stdout.contains("[0] rank 0: done: 4 ranks joined"), "{stdout}");
}

/// The demo names the backend its hosts' links took: ucx when told to, where UCX is.
#[test]
fn the_demo_says_which_links_join_its_hosts() {
    if let Err(why) = symmem::transport::ucx::available() {
        eprintln!("SKIPPED: no ucx here ({why})");
        return;
    }
    let out = Command::new(BIN)
        .args(["demo", "--hosts", "2"])
        .env_remove("SYMMEM_STORE_SECRET")
        .env("SYMMEM_XHOST_BACKEND", "ucx")
        .env("UCX_TLS", "tcp")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("shared memory and ucx links between hosts"), "{stdout}");
}

#[test]
fn a_multi_host_job_runs_as_two_launchers() {
    // Two launchers on this host play two hosts of one job. They share a home directory, so
    // this user's key (made by whichever comes first) is the job's secret, with no setting.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let config = tempfile::tempdir().unwrap();
    let node = |i: &str| {
        Command::new(BIN)
            .args(["run", "-n", "2", "--nnodes", "2", "--node-rank", i, "--master-port", &port, "--", "sh", "-c"])
            .arg("echo $RANK/$WORLD_SIZE/$LOCAL_RANK")
            .env("XDG_CONFIG_HOME", config.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (node("0"), node("1"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "{}\n{}", text(&a.stderr), text(&b.stderr));
    let mut lines: Vec<String> = text(&a.stdout).lines().chain(text(&b.stdout).lines()).map(str::to_string).collect();
    lines.sort();
    assert_eq!(lines, vec!["[0] 0/4/0", "[1] 1/4/1", "[2] 2/4/0", "[3] 3/4/1"]);
}

#[test]
fn a_failure_on_one_host_stops_the_other() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let config = tempfile::tempdir().unwrap();
    let node = |i: &str, script: &str| {
        Command::new(BIN)
            .args(["run", "-n", "1", "--nnodes", "2", "--node-rank", i, "--master-port", &port, "--", "sh", "-c"])
            .arg(script)
            .env("XDG_CONFIG_HOME", config.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let t = Instant::now();
    let (a, b) = (node("0", "sleep 30"), node("1", "sleep 0.3; exit 5"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert_eq!(b.status.code(), Some(5));
    assert_eq!(a.status.code(), Some(1), "{}", text(&a.stderr));
    assert!(text(&a.stderr).contains("rank 1 exited with code 5 on node 1"), "{}", text(&a.stderr));
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// A child process that is killed if the test fails before it ends the child itself.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Errors mean the child was already reaped: nothing left to clean up.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn standalone_store_serves_clients() {
    // The store's secret is this user's key, made on first use: in a scratch config directory.
    let config = tempfile::tempdir().unwrap();
    let mut guard = KillOnDrop(
        Command::new(BIN)
            .args(["store", "--host", "127.0.0.1", "--port", "0"])
            .env("XDG_CONFIG_HOME", config.path())
            .env_remove("SYMMEM_STORE_SECRET")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let server = &mut guard.0;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut line).unwrap();
    let addr = line.split_whitespace().nth(4).unwrap().to_string();
    assert!(line.contains("this user's key"), "{line}");
    let key = config.path().join("symmem/secret");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    // This user's processes on this host need no secret; others present the key.
    let store = symmem::TcpStore::connect(&addr, Default::default()).unwrap();
    use symmem::Store;
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    let secret = symmem::store::Secret::from_file(&key).unwrap();
    let options = symmem::store::ClientOptions { secret: Some(secret), ..Default::default() };
    assert_eq!(symmem::TcpStore::connect(&addr, options).unwrap().get("k").unwrap(), b"v");
    Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
    assert!(server.wait().unwrap().success());
}

#[test]
fn store_commands_script_a_running_store() {
    let server = symmem::store::StoreServer::start("127.0.0.1:0", Default::default()).unwrap();
    let addr = server.local_addr().to_string();
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["store"])
            .args(args)
            .args(["--addr", &addr])
            .env_remove("SYMMEM_STORE_SECRET")
            .output()
            .unwrap();
        (out.status.code(), text(&out.stdout).trim().to_string(), text(&out.stderr))
    };
    assert_eq!(run(&["set", "greeting", "hello"]).0, Some(0));
    assert_eq!(run(&["get", "greeting"]).1, "hello");
    assert_eq!(run(&["add", "n", "-3"]).1, "-3");
    assert_eq!(run(&["add", "n", "10"]).1, "7");
    assert!(run(&["ping"]).1.ends_with(" us"));
    assert_eq!(run(&["wait", "greeting", "n"]).0, Some(0));
    let (code, _, err) = run(&["wait", "never", "--timeout", "0.2"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("timed out") && err.contains("never"), "{err}");
    // The keys are PyTorch's: a Rust client sees what the command set.
    use symmem::Store;
    let c = symmem::TcpStore::connect(&addr, Default::default()).unwrap();
    assert_eq!(c.get("greeting").unwrap(), b"hello");
}

/// Issue 51, item 3: a finite but huge timeout (`1e19` s, past what an `Instant` holds) made
/// the launcher, the store commands and every rank panic ("overflow when adding duration to
/// instant"). It now means "no deadline" wherever a timeout is given: the launcher's flag, the
/// store commands' and the two knobs every rank reads (here through the demo on two hosts:
/// store calls, rendezvous, signals, the links between hosts and operators). Not finite, or
/// negative, it is refused by name.
#[test]
fn a_huge_timeout_means_no_deadline_everywhere() {
    for t in ["1e19", "1e300"] {
        let out = symmem(&["run", "-n", "2", "--timeout", t, "--", "true"]);
        assert!(out.status.success(), "--timeout {t}: {}", text(&out.stderr));
    }
    for bad in ["inf", "nan", "-1"] {
        let out = symmem(&["run", "-n", "1", &format!("--timeout={bad}"), "--", "true"]);
        assert!(!out.status.success(), "--timeout {bad} was accepted");
        assert!(text(&out.stderr).contains("--timeout must be"), "--timeout {bad}: {}", text(&out.stderr));
    }
    let server = symmem::store::StoreServer::start("127.0.0.1:0", Default::default()).unwrap();
    let addr = server.local_addr().to_string();
    for args in [["set", "k", "v"].as_slice(), &["get", "k"], &["wait", "k"]] {
        let out = Command::new(BIN)
            .arg("store")
            .args(args)
            .args(["--addr", &addr, "--timeout", "1e19"])
            .env_remove("SYMMEM_STORE_SECRET")
            .output()
            .unwrap();
        assert!(out.status.success(), "store {args:?} --timeout 1e19: {}", text(&out.stderr));
    }
    let out = Command::new(BIN)
        .args(["demo", "--hosts", "2"])
        .env_remove("SYMMEM_STORE_SECRET")
        .env("SYMMEM_OP_TIMEOUT", "1e22")
        .env("SYMMEM_STORE_TIMEOUT", "1e19")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[0] rank 0: done: 4 ranks joined"), "{stdout}");
}

#[test]
fn info_lists_every_knob() {
    let out = symmem(&["info"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for k in symmem::config::KNOBS {
        assert!(s.contains(k.env), "info does not mention {}", k.env);
    }
    assert!(s.contains("/dev/shm"), "{s}");
}

/// `symmem info` lists every transport and device UCX offers here, as UCX's own `ucx_info -d`
/// does, and says whether `auto` would take UCX (never through UCX's tcp); with `UCX_TLS` set,
/// only what it allows.
#[test]
fn info_lists_the_ucx_transports_ucx_info_reports() {
    if let Err(why) = symmem::transport::ucx::available() {
        eprintln!("SKIPPED: no ucx here ({why})");
        return;
    }
    let Ok(ui) = Command::new("ucx_info").arg("-d").env_remove("UCX_TLS").output() else {
        eprintln!("SKIPPED: no ucx_info (Debian: ucx-utils)");
        return;
    };
    let (mut want, mut tl, mut dev) = (Vec::new(), String::new(), String::new());
    for line in text(&ui.stdout).lines() {
        let line = line.trim_start_matches('#').trim();
        if let Some(v) = line.strip_prefix("Transport: ") {
            tl = v.to_string();
        } else if let Some(v) = line.strip_prefix("Device: ") {
            dev = v.to_string();
        } else if let Some(v) = line.strip_prefix("Type: ") {
            let kind = match v {
                "network" => "network",
                "intra-node" => "shared memory",
                "loopback" => "loopback",
                "accelerator" => "accelerator",
                other => panic!("ucx_info reports a device type this test does not know: {other}"),
            };
            want.push((tl.clone(), format!("{tl}/{dev} ({kind})")));
        }
    }
    assert!(want.iter().any(|(tl, _)| tl == "tcp"), "ucx_info -d lists no tcp: {}", text(&ui.stdout));
    let info = |tls: Option<&str>| {
        let mut c = Command::new(BIN);
        c.arg("info").env_remove("SYMMEM_XHOST_BACKEND");
        match tls {
            Some(t) => c.env("UCX_TLS", t),
            None => c.env_remove("UCX_TLS"),
        };
        let out = c.output().unwrap();
        assert!(out.status.success());
        text(&out.stdout)
    };
    let s = info(None);
    for (_, line) in &want {
        assert!(s.contains(line), "info does not list {line}: {s}");
    }
    let fabric = want.iter().any(|(tl, line)| tl != "tcp" && line.ends_with("(network)"));
    if !fabric {
        assert!(s.contains("else tcp (not ucx: ") && s.contains("no network transport but tcp"), "{s}");
    }
    let s = info(Some("tcp"));
    for (tl, line) in &want {
        assert_eq!(s.contains(line), tl == "tcp", "UCX_TLS=tcp, {line}: {s}");
    }
}

/// A machine without UCX: `libucp.so.0` (and `libuct.so.0`) made unloadable in a mount
/// namespace of the test's own (bind-mounting an empty file over them). symmem says ucx is
/// unavailable and why, `auto` and the links between hosts go over tcp, and asking for ucx by
/// name fails with the reason instead of aborting. Skipped without root or mount namespaces.
#[test]
fn without_libucx_ucx_says_why_and_everything_else_works() {
    let lib = |name: &str| {
        let out = Command::new("ldconfig").arg("-p").output().ok()?;
        let line = text(&out.stdout).lines().find(|l| l.trim_start().starts_with(name))?.to_string();
        std::fs::canonicalize(line.rsplit("=> ").next()?.trim()).ok()
    };
    let (Some(ucp), Some(uct)) = (lib("libucp.so.0 "), lib("libuct.so.0 ")) else {
        eprintln!("SKIPPED: no libucx here to hide (the whole suite runs without it)");
        return;
    };
    let hide = format!("mount --bind /dev/null {} && mount --bind /dev/null {} && ", ucp.display(), uct.display());
    let run = |script: &str| {
        Command::new("unshare")
            .args(["-m", "sh", "-c", &format!("{hide}{script}")])
            .env_remove("SYMMEM_STORE_SECRET")
            .env_remove("SYMMEM_XHOST_BACKEND")
            .output()
    };
    match run("true") {
        Ok(o) if o.status.success() => {}
        _ => {
            eprintln!("SKIPPED: no mount namespace here (needs root)");
            return;
        }
    }
    let out = run(&format!("{BIN} info")).unwrap();
    let info = text(&out.stdout);
    assert!(out.status.success() && info.contains("ucx: unavailable (libucp.so.0 cannot be loaded"), "{info}");
    assert!(info.contains("else tcp\n"), "{info}");
    let out = run(&format!("{BIN} demo --hosts 2")).unwrap();
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    assert!(text(&out.stdout).contains("tcp links between hosts"), "{}", text(&out.stdout));
    let out = run(&format!("SYMMEM_XHOST_BACKEND=ucx {BIN} demo --hosts 2")).unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the ucx transport is unsupported") && err.contains("libucp.so.0 cannot be loaded"), "{err}");
}

#[test]
fn bench_signal_emits_the_baselines_pinned_and_unpinned_and_every_rank_count() {
    let out = symmem(&["bench", "signal", "--json", "--ranks", "2,3", "--iters", "200"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(String, u64)> =
        rows.iter().map(|r| (r["bench"].as_str().unwrap().to_string(), r["ranks"].as_u64().unwrap())).collect();
    let want = [
        ("flag_pingpong", 2),
        ("flag_pingpong_unpinned", 2),
        ("signal_pingpong_pinned", 2),
        ("signal_pingpong", 2),
        ("put_with_signal_pingpong", 2),
        ("put_signal_pingpong", 2),
        ("barrier", 2),
        ("barrier", 3),
    ];
    assert_eq!(got, want.map(|(b, n)| (b.to_string(), n)));
    for r in &rows {
        assert!(r["time_us"].as_f64().is_some_and(|v| v > 0.0) && r["iters"].as_u64() == Some(200), "{r}");
    }
    // Across two played hosts: the signal runs say so, the shared-memory baseline stays on one.
    let out = symmem(&["bench", "signal", "--json", "--ranks", "2", "--iters", "100", "--hosts", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(&str, u64)> =
        rows.iter().map(|r| (r["bench"].as_str().unwrap(), r["hosts"].as_u64().unwrap())).collect();
    assert_eq!(
        got,
        [
            ("flag_pingpong", 1),
            ("flag_pingpong_unpinned", 1),
            ("signal_pingpong_pinned", 2),
            ("signal_pingpong", 2),
            ("put_with_signal_pingpong", 2),
            ("put_signal_pingpong", 2),
            ("barrier", 2)
        ]
    );
}

#[test]
fn bench_link_setup_counts_the_keys_of_each_layout_and_refuses_counts_too_large() {
    let out = symmem(&["bench", "link-setup", "--json", "--hosts", "2,4", "--per-host", "2", "--all-pairs-max", "6"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(&str, u64, u64, u64)> = rows[..3]
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
            (r["bench"].as_str().unwrap(), n("hosts"), n("keys"), n("linking_ranks"))
        })
        .collect();
    // All pairs: every rank publishes a URL per rank on another host (4 × 2 at 2 hosts); 8
    // ranks exceed --all-pairs-max and are modelled instead. Leaders: one per host, H − 1 each.
    assert_eq!(got[..3], [("links_all_pairs", 2, 8, 4), ("links_leaders", 2, 2, 2), ("links_leaders", 4, 12, 4)]);
    let model = &rows[3];
    assert_eq!(model["bench"], "links_all_pairs_model");
    assert_eq!((model["keys"].as_u64(), model["hosts"].as_u64()), (Some(8 * 6), Some(4)), "{model}");
    assert_eq!(rows.len(), 4);

    let huge = (u64::MAX / 3).to_string();
    let out = symmem(&["bench", "link-setup", "--hosts", &huge, "--per-host", "8"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains(&format!("--hosts {huge} with --per-host 8")), "{err}");
}

#[test]
fn bench_transport_emits_rows_and_baselines() {
    let out = symmem(&["bench", "transport", "--json", "--sizes", "8,65536", "--window", "4"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(String, u64)> =
        rows.iter().map(|r| (r["bench"].as_str().unwrap().to_string(), r["size"].as_u64().unwrap())).collect();
    let want = [
        ("tcp_stream", 65536),
        ("tcp_pingpong", 8),
        ("tcp_pingpong_spin", 8),
        ("write", 8),
        ("read", 8),
        ("write", 65536),
        ("read", 65536),
    ];
    assert_eq!(got, want.map(|(b, n)| (b.to_string(), n)));
    for r in &rows {
        // Every row's time is real (the stream's too: its mean per message), and algbw is
        // size / time.
        let (size, time) = (r["size"].as_f64().unwrap(), r["time_us"].as_f64().unwrap());
        assert!(time > 0.0, "{r}");
        assert_close(r["algbw"].as_f64().unwrap(), size / time / 1e3, r);
        let pingpong = r["bench"].as_str().is_some_and(|b| b.starts_with("tcp_pingpong"));
        assert!(r["stream_gbps"].as_f64().is_some_and(|g| g > 0.0) || pingpong, "{r}");
    }
    // shm: memcpy and process_vm_writev baselines, then heap (cross-memory attach) and shared
    // (mapped) memory.
    let out = symmem(&["bench", "transport", "--backend", "shm", "--json", "--sizes", "4096"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{}{}",
                r["bench"].as_str().unwrap(),
                r["memory"].as_str().map(|m| format!("/{m}")).unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(got, ["memcpy", "process_vm_writev", "write/heap", "read/heap", "write/shared", "read/shared"]);
}

/// `got` equals `want` to the six significant digits the bench prints.
fn assert_close(got: f64, want: f64, row: &serde_json::Value) {
    assert!((got - want).abs() <= want.abs() * 2e-5 + 1e-12, "{got} != {want} in {row}");
}

/// nccl-tests' bus-bandwidth factor.
fn bus_factor(op: &str, n: f64) -> f64 {
    if op == "all_reduce" { 2.0 * (n - 1.0) / n } else { (n - 1.0) / n }
}

#[test]
fn bench_collectives_report_nccl_tests_fields_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("ar.svg");
    let png = dir.path().join("ar.png");
    let out = symmem(&[
        "bench",
        "all-reduce",
        "--json",
        "-n",
        "3",
        "--sizes",
        "8,64K",
        "--iters",
        "50",
        "--no-baseline",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    let fields = ["bench", "ranks", "hosts", "size", "count", "dtype", "iters", "time_us", "p99_us", "algbw", "busbw"];
    for r in &rows {
        for f in fields {
            assert!(!r[f].is_null(), "{f} missing in {r}");
        }
        assert_eq!(
            (r["bench"].as_str(), r["ranks"].as_u64(), r["dtype"].as_str()),
            (Some("all_reduce"), Some(3), Some("float32"))
        );
        let (size, time) = (r["size"].as_f64().unwrap(), r["time_us"].as_f64().unwrap());
        assert_eq!(r["count"].as_f64().unwrap() * 4.0, size, "{r}");
        assert!(time > 0.0 && r["p99_us"].as_f64().unwrap() >= time, "{r}");
        assert_close(r["algbw"].as_f64().unwrap(), size / time / 1e3, r);
        assert_close(r["busbw"].as_f64().unwrap(), r["algbw"].as_f64().unwrap() * bus_factor("all_reduce", 3.0), r);
        assert!(matches!(r["algo"].as_str(), Some("one_shot" | "two_shot")), "{r}");
    }
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.contains("<svg") && drawn.contains("time per operation") && drawn.contains("busbw"), "an SVG plot");
    assert!(
        drawn.contains("64 KiB") && drawn.contains("3 ranks on 1 host"),
        "ticks in KiB (the largest size labelled) and a title"
    );
    // The CSV carries the same fields, and the other collectives their own bus factor.
    for op in ["all-gather", "reduce-scatter", "all-to-all", "all-to-all-v"] {
        let out = symmem(&["bench", op, "--csv", "--ranks", "2", "--sizes", "4K", "--iters", "20", "--no-baseline"]);
        assert!(out.status.success(), "{op}: {}", text(&out.stderr));
        let t = text(&out.stdout);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2, "{op}: a header and one row: {t}");
        let names: Vec<&str> = lines[0].split(',').collect();
        assert_eq!(&names[..fields.len()], fields, "{op}");
        let cells: Vec<&str> = lines[1].split(',').collect();
        let get = |f: &str| cells[names.iter().position(|n| *n == f).unwrap()].parse::<f64>().unwrap();
        let row = serde_json::json!(lines[1]);
        assert_close(get("algbw"), get("size") / get("time_us") / 1e3, &row);
        assert_close(get("busbw"), get("algbw") * bus_factor(&op.replace('-', "_"), 2.0), &row);
    }
    // A PNG too.
    let out = symmem(&[
        "bench",
        "all-gather",
        "-n",
        "2",
        "--sizes",
        "4K 64K",
        "--iters",
        "20",
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"), "a PNG was drawn");
}

#[test]
fn bench_all_reduce_measures_open_mpi_alongside_when_installed() {
    let have = |t: &str| Command::new(t).arg("--version").output().is_ok_and(|o| o.status.success());
    if !have("mpicc") || !have("mpirun") {
        eprintln!("SKIPPED: Open MPI (mpicc, mpirun) is not installed");
        return;
    }
    let out = symmem(&["bench", "all-reduce", "--json", "-n", "2", "--sizes", "8,4K", "--iters", "50"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(&str, u64)> =
        rows.iter().map(|r| (r["bench"].as_str().unwrap(), r["size"].as_u64().unwrap())).collect();
    assert_eq!(got, [("all_reduce", 8), ("all_reduce", 4096), ("mpi_allreduce", 8), ("mpi_allreduce", 4096)]);
    for r in &rows[2..] {
        assert!(r["note"].as_str().unwrap().starts_with("baseline: Open MPI"), "{r}");
        assert_close(
            r["busbw"].as_f64().unwrap(),
            r["size"].as_f64().unwrap() / r["time_us"].as_f64().unwrap() / 1e3,
            r,
        );
    }
}

#[test]
fn bench_prints_each_row_as_its_size_finishes() {
    use std::io::BufRead;
    // The second size takes seconds; the first row must be out while it runs.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_symmem"))
        .args(["bench", "all-reduce", "-n", "2", "--sizes", "8,16M", "--iters", "10", "--warmup", "5", "--no-baseline"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let header = lines.next().unwrap().unwrap();
    assert!(header.contains("time_us") && header.contains("busbw"), "{header}");
    let first = lines.next().unwrap().unwrap();
    let running = child.try_wait().unwrap().is_none();
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    assert!(child.wait().unwrap().success());
    assert!(first.starts_with("all_reduce") && first.split_whitespace().nth(3) == Some("8"), "{first}");
    assert!(running, "the 8-byte row was printed only when the whole sweep had ended");
    assert_eq!(rest.len(), 1, "{rest:?}");
}

#[test]
fn bench_store_emits_json_lines() {
    let out =
        symmem(&["bench", "store", "--json", "--clients", "2", "--ops", "50", "--ranks", "4,8", "--per-key-max", "4"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = rows.iter().map(|r| r["bench"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        vec![
            "tcp_pingpong",
            "store_add_sync",
            "store_barrier",
            "store_set",
            "store_get",
            "store_add",
            "rendezvous_get",
            "rendezvous_multi_get",
            "rendezvous_multi_get"
        ]
    );
    assert_eq!(rows[2]["ranks"], 2, "the barrier is of two ranks");
    for r in &rows {
        for field in ["ranks", "iters", "time_us", "p99_us", "ops_per_s"] {
            assert!(r[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {r}");
        }
    }
}

#[test]
fn one_size_parser_takes_units_and_separators_and_refuses_the_rest() {
    for (arg, want) in [
        (vec!["8"], "8"),
        (vec!["8,4K,64KiB"], "8 4096 65536"),
        (vec!["8 4k", "1M,2MiB"], "8 4096 1048576 2097152"),
        (vec!["1G, 16B"], "1073741824 16"),
        (vec!["3gib", "2m"], "3221225472 2097152"),
    ] {
        let mut args = vec!["__sizes"];
        args.extend(arg.iter().copied());
        let out = symmem(&args);
        assert!(out.status.success(), "{arg:?}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout).trim(), want, "{arg:?}");
    }
    // 2^54 KiB is 2^64 bytes: it wrapped to 0 once; now every parser refuses it by name.
    for bad in ["18014398509481984K", "4Q", "1.5K", "-8", "K", "4 KiB", "2MB"] {
        let out = symmem(&["__sizes", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = text(&out.stderr);
        assert!(err.contains("is not a number of bytes") && err.contains("KiB"), "{bad:?}: {err}");
    }
    for args in [
        ["bench", "transport", "--sizes", "18014398509481984K"],
        ["bench", "all-reduce", "--sizes", "4Q"],
        ["bench", "all-to-all", "--sizes", "1.5M"],
    ] {
        let out = symmem(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains("is not a number of bytes"), "{args:?}");
    }
    // Every default a help text shows is one the parser takes.
    for cmd in ["all-reduce", "transport"] {
        let help = text(&symmem(&["bench", cmd, "--help"]).stdout);
        assert!(help.contains("KiB"), "{help}");
        let default =
            help.split("[default: 8").nth(1).and_then(|d| d.split(']').next()).map(|d| format!("8{d}")).unwrap();
        let out = symmem(&["__sizes", &default]);
        assert!(out.status.success(), "{cmd}: default {default:?} refused: {}", text(&out.stderr));
    }
}

#[test]
fn rank_counts_are_n_everywhere_with_the_old_spellings_as_aliases() {
    for flag in ["-n", "--nproc", "--nproc-per-node", "--nproc_per_node"] {
        let out = symmem(&["run", flag, "2", "--", "sh", "-c", "echo \"ws=$WORLD_SIZE\""]);
        assert!(out.status.success(), "{flag}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout).matches("ws=2").count(), 2, "{flag}");
    }
    for flag in ["-n", "--nproc", "--ranks"] {
        let out = symmem(&["bench", "signal", "--json", flag, "2", "--iters", "20"]);
        assert!(out.status.success(), "{flag}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains("\"barrier\""), "{flag}");
    }
    let out =
        symmem(&["bench", "all-to-all", "--ranks", "2", "--sizes", "1K", "--iters", "5", "--json", "--no-baseline"]);
    assert!(out.status.success() && text(&out.stdout).contains("\"ranks\":2"), "{}", text(&out.stderr));
    // Values outside a set are answered with the set.
    let out = symmem(&["bench", "all-reduce", "--algo", "three_shot"]);
    let err = text(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("one_shot") && err.contains("two_shot"), "{err}");
    let out = symmem(&["bench", "all-reduce", "--dtype", "float8"]);
    let err = text(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("bfloat16") && err.contains("int64"), "{err}");
    // --algo is only where it means something.
    let out = symmem(&["bench", "all-gather", "--algo", "one_shot"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn version_names_the_release_and_the_commit() {
    let v = text(&symmem(&["--version"]).stdout);
    assert!(v.starts_with(&format!("symmem {} (commit ", env!("CARGO_PKG_VERSION"))), "{v}");
}

#[test]
fn run_records_a_failed_ranks_error_file_as_the_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.json");
    // Rank 1 records its failure in torchrun's format and exits 3; rank 0 waits to be stopped.
    let rank = r#"if [ "$RANK" = 1 ]; then
        printf '{"message":{"message":"ValueError: bad shard","extraInfo":{"py_callstack":"tb line","timestamp":"1"}}}' > "$TORCHELASTIC_ERROR_FILE"
        exit 3
    fi
    sleep 30"#;
    let out = Command::new(BIN)
        .args(["run", "-n", "2", "--", "sh", "-c", rank])
        .env("TORCHELASTIC_ERROR_FILE", &job)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    assert!(
        err.contains("root cause (rank 1's error file): ValueError: bad shard") && err.contains("tb line"),
        "{err}"
    );
    assert!(err.contains("OMP_NUM_THREADS=1"), "the notice: {err}");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&job).unwrap()).unwrap();
    assert_eq!(j["message"]["message"], "ValueError: bad shard");
    assert_eq!(j["message"]["errorCode"], 3);
    // A rank that writes nothing still leaves a root cause, named by rank and exit.
    let child = Command::new(BIN)
        .args(["run", "-n", "2", "--", "sh", "-c", "[ \"$RANK\" = 0 ] && kill -9 $$; sleep 30"])
        .env("TORCHELASTIC_ERROR_FILE", &job)
        .env("OMP_NUM_THREADS", "4")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let launcher = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(137));
    assert!(!text(&out.stderr).contains("OMP_NUM_THREADS=1"), "no notice when it is set");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&job).unwrap()).unwrap();
    let m = j["message"]["message"].as_str().unwrap();
    assert!(m.contains("rank 0") && m.contains("SIGKILL") && j["message"]["errorCode"] == 137, "{j}");
    // The per-rank error files went with the job.
    let leftover = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with(&format!("symmem-run-{launcher}-")));
    assert!(!leftover);
}

/// `--pin` reaches the ranks of a collective benchmark: its rows say whether the calling
/// thread was bound, and rows without it say nothing; the rows are timed as usual either way.
#[test]
fn bench_collective_pin_binds_the_callers_and_says_so() {
    let run = |pin: bool| {
        let mut args = vec!["bench", "all-reduce", "--json", "-n", "2", "--sizes", "8,4K", "--iters", "50"];
        args.extend(["--warmup", "5", "--no-baseline"]);
        if pin {
            args.push("--pin");
        }
        let out = symmem(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let rows: Vec<serde_json::Value> =
            text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(rows.len(), 2, "{rows:?}");
        for r in &rows {
            assert!(r["time_us"].as_f64().is_some_and(|v| v > 0.0) && r["iters"].as_u64() == Some(50), "{r}");
        }
        rows
    };
    // The rows are rank 0's, bound to CPU 0 (rank modulo the CPUs): refused where this
    // process may not run there.
    let can_pin = rustix::thread::sched_getaffinity(None).unwrap().is_set(0);
    for r in run(true) {
        assert_eq!(r["pinned"].as_bool(), Some(can_pin), "{r}");
    }
    for r in run(false) {
        assert!(r.get("pinned").is_none(), "{r}");
    }
}
