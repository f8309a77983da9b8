"""Runs the CPU ports of PyTorch's upstream suites under torchrun and prints, per file and rank
count, how many tests pass, fail or do not apply on the CPU (skipped).

The ports are not in the repository: ``port.py`` writes them from the upstream files you
download (README.md says where from) into a directory of your choice, ``ported/`` beside this
file by default (git-ignored). This script reads them from ``--port-dir``, else from
``$SYMMEM_UPSTREAM_PORT``, else from ``ported/``:

    python python/tests/upstream/run.py --port-dir DIR            # every file, 2 and 4 ranks
    python python/tests/upstream/run.py --nproc 2 test_nccl.py -k test_get
    python python/tests/upstream/run.py --json results.json --failures

Each rank forks one child per test (worker.py), so a failing, hanging or exiting test takes down
nothing else; a hang is killed after --test-timeout seconds, or --grace seconds after the other
ranks finished, and counts as a failure. Use the Python of a venv with torch and symmem
(SYMMEM_TORCH_PYTHON).
"""

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")

#: The ported files, in the order of the table.
FILES = ("test_symmetric_memory.py", "test_nvshmem.py", "test_nccl.py", "test_docs_symmetric_memory.py")

#: Where port.py writes the ports unless told otherwise (git-ignored).
DEFAULT_PORT_DIR = os.path.join(HERE, "ported")


def port_dir(given=None):
    """The directory of the ports: ``given``, else ``$SYMMEM_UPSTREAM_PORT``, else ``ported/``."""
    return os.path.abspath(given or os.environ.get("SYMMEM_UPSTREAM_PORT") or DEFAULT_PORT_DIR)


class MissingPort(Exception):
    """A ported file this run needs is not there."""


def resolve(name, directory):
    """The path of the ported file ``name`` (a file name in ``directory``, or a path)."""
    path = name if os.sep in name else os.path.join(directory, name)
    if not os.path.isfile(path):
        raise MissingPort(
            f"no ported file {path}\n"
            "The CPU ports of PyTorch's files are not in the repository: download the upstream "
            "files (python/tests/upstream/README.md lists their URLs), write the ports with\n"
            "    python python/tests/upstream/port.py -o DIR FILE...\n"
            "and run this again with --port-dir DIR (or SYMMEM_UPSTREAM_PORT=DIR)."
        )
    return os.path.abspath(path)


def run_suite(path, nproc, *, keywords=(), test_timeout=60.0, grace=10.0, python=sys.executable, log=None, traces=None):
    """Runs the ported file at ``path`` at ``nproc`` ranks; returns {test id: {"outcome",
    "detail", "seconds"}} with the ranks' outcomes merged (a test fails if it failed on any
    rank). ``traces``: a directory to keep the failures' tracebacks in.

    A test whose process group could not be made (a failure of the harness, not of the test:
    "harness: _init_pg: ...") runs once more, in a launch of its own; its result says so."""
    kwargs = dict(test_timeout=test_timeout, grace=grace, python=python, log=log, traces=traces)
    results = _run_launches(path, nproc, keywords=keywords, only=None, **kwargs)
    again = [t for t, r in results.items() if r["outcome"] == "fail" and "harness:" in r["detail"]]
    if again:
        retried = _run_launches(path, nproc, keywords=(), only=again, **kwargs)
        for t in again:
            if t in retried:
                first = results[t]["detail"]
                results[t] = dict(retried[t], retried_after=first)
    return results


def _run_launches(path, nproc, *, keywords, only, test_timeout, grace, python, log, traces):
    name = os.path.basename(path)
    tmp = tempfile.mkdtemp(prefix="symmem-upstream-")
    try:
        out = os.path.join(tmp, "out")
        os.mkdir(out)
        env = dict(os.environ)
        env.update(
            UPSTREAM_TMP=tmp,
            TMPDIR=tmp,
            OMP_NUM_THREADS="1",
            SYMMEM_JOB_SECRET=secrets.token_hex(16),
            # Bounds for a test left waiting on a peer; the worker kills sooner (--grace).
            SYMMEM_OP_TIMEOUT="30",
            SYMMEM_STORE_TIMEOUT="60",
            PYTHONUNBUFFERED="1",
            # torch's store barrier at the end of init_process_group and new_group: a rank
            # whose test is over at once must not exit while a peer still connects its gloo
            # pairs to it ("connectFullMesh failed: Connection closed by peer").
            TORCH_DIST_INIT_BARRIER="1",
        )
        done_file = os.path.join(tmp, "done")
        attempts = 0
        while True:
            attempts += 1
            cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            cmd += ["--max-restarts=0", WORKER, "--out", out, "--test-timeout", str(test_timeout)]
            cmd += ["--grace", str(grace), "--done", done_file, path]
            for k in keywords:
                cmd += ["-k", k]
            if only is not None:
                only_file = os.path.join(tmp, "only")
                with open(only_file, "w") as f:
                    f.write("\n".join(only))
                cmd += ["--only", only_file]
            budget = _budget(out, test_timeout)
            with open(log or os.devnull, "a") as sink:
                proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                try:
                    code = proc.wait(timeout=budget)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code = "killed"
            results, tests = merge(out, nproc)
            missing = [t for t in tests if t not in results]
            if not missing or code == 0 or attempts >= 3 or tests is None:
                break
            # A rank died between tests: start again after the tests already recorded.
            with open(done_file, "w") as f:
                f.write("\n".join(results))
        for t in tests or []:
            if t not in results:
                results[t] = {"outcome": "fail", "detail": f"no result (the suite's launcher ended: {code})", "seconds": 0}
        if traces:
            os.makedirs(traces, exist_ok=True)
            for r in range(nproc):
                src = os.path.join(out, f"trace-rank{r}.txt")
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(traces, f"{os.path.splitext(name)[0]}-{nproc}-rank{r}.txt"))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _budget(out, test_timeout):
    """How long one launch may take: every remaining test at its timeout, at most an hour."""
    try:
        with open(os.path.join(out, "tests.json")) as f:
            n = len(json.load(f))
    except (OSError, ValueError):
        n = 200
    return min(3600.0, 120.0 + n * 2.0 + 3 * test_timeout)


def merge(out, nproc):
    """The ranks' records merged per test, and the suite's test ids (None if it never listed them)."""
    try:
        with open(os.path.join(out, "tests.json")) as f:
            tests = json.load(f)
    except (OSError, ValueError):
        tests = None
    per_test = {}
    for r in range(nproc):
        try:
            with open(os.path.join(out, f"rank{r}.jsonl")) as f:
                lines = [json.loads(line) for line in f if line.strip()]
        except OSError:
            lines = []
        for line in lines:
            per_test.setdefault(line["test"], {})[r] = line
    results = {}
    for tid, ranks in per_test.items():
        if len(ranks) < nproc:
            lost = sorted(set(range(nproc)) - set(ranks))
            results[tid] = {"outcome": "fail", "detail": f"no result from rank(s) {lost}", "seconds": 0}
            continue
        outcomes = {r: ranks[r]["outcome"] for r in ranks}
        seconds = max(ranks[r]["seconds"] for r in ranks)
        failed = [r for r in sorted(ranks) if outcomes[r] == "fail"]
        if failed:
            # The cause first, not its echoes: a rank killed while waiting for a peer comes
            # after it, a rank whose gloo connection a dead peer closed last.
            failed.sort(key=lambda r: _echo_rank(ranks[r]["detail"]))
            r = failed[0]
            others = sorted({ranks[o]["detail"][:200] for o in failed[1:]} - {ranks[r]["detail"][:200]})
            detail = f"rank {r}: {ranks[r]['detail']}"
            if others:
                detail += " (other ranks: " + " | ".join(others) + ")"
            results[tid] = {"outcome": "fail", "detail": detail, "seconds": seconds}
        elif all(o == "skip" for o in outcomes.values()):
            results[tid] = {"outcome": "skip", "detail": ranks[0]["detail"], "seconds": seconds}
        else:
            results[tid] = {"outcome": "pass", "detail": "", "seconds": seconds}
    return results, tests


#: What a rank reports when a peer's process died under a gloo collective.
GLOO_ECHOES = ("Connection closed by peer", "Read error", "Connection reset by peer")


def _echo_rank(detail):
    """0 for a failure of the rank's own, 1 for a hang or timeout, 2 for a dead peer's echo."""
    if any(e in detail for e in GLOO_ECHOES):
        return 2
    return 1 if detail.startswith(("hang:", "timeout:")) else 0


def counts(results):
    c = {"pass": 0, "fail": 0, "skip": 0}
    for r in results.values():
        c[r["outcome"]] += 1
    return c


def _rank_counts(text):
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rank counts are positive integers, comma-separated (2,4)")
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help=f"ported files, names in the port directory or paths (default: {', '.join(FILES)})")
    p.add_argument("--port-dir", help="directory of the ports (default: $SYMMEM_UPSTREAM_PORT, else ported/ beside this file)")
    p.add_argument("--nproc", type=_rank_counts, default=[2, 4], help="rank counts, comma-separated (default: 2,4)")
    p.add_argument("-k", dest="keywords", action="append", default=[], help="only tests whose id contains this")
    p.add_argument("--test-timeout", type=float, default=60.0, help="seconds one test may take")
    p.add_argument("--grace", type=float, default=10.0, help="seconds a rank may outlive the others in a test")
    p.add_argument("--json", help="write every test's outcome to this file")
    p.add_argument("--failures", action="store_true", help="list the failing tests with their first error line")
    p.add_argument("--log", help="append the ranks' own output to this file")
    p.add_argument("--traces", help="keep the failing tests' tracebacks in this directory")
    args = p.parse_args()
    directory = port_dir(args.port_dir)
    try:
        paths = [resolve(f, directory) for f in args.files or FILES]
    except MissingPort as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2

    rows, everything = [], []
    for path in paths:
        name = os.path.basename(path)
        for n in args.nproc:
            start = time.monotonic()
            results = run_suite(
                path, n, keywords=args.keywords, test_timeout=args.test_timeout, grace=args.grace, log=args.log,
                traces=args.traces,
            )
            c = counts(results)
            rows.append((name, n, c["pass"], c["fail"], c["skip"], time.monotonic() - start))
            for tid, r in results.items():
                everything.append({"file": name, "nproc": n, "test": tid, **r})
            print(f"{name} at {n} ranks: {c['pass']} pass, {c['fail']} fail, {c['skip']} n/a", file=sys.stderr)

    width = max(len(r[0]) for r in rows)
    print(f"{'file':<{width}}  ranks  pass  fail   n/a  seconds")
    for name, n, ok, bad, na, secs in rows:
        print(f"{name:<{width}}  {n:>5}  {ok:>4}  {bad:>4}  {na:>4}  {secs:>7.1f}")
    if args.failures:
        for r in everything:
            if r["outcome"] == "fail":
                print(f"FAIL {r['file']} [{r['nproc']}] {r['test']}: {r['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": [dict(zip(("file", "nproc", "pass", "fail", "na", "seconds"), r)) for r in rows],
                       "results": everything}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
