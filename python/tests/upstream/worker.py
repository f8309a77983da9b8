"""One rank of a ported upstream suite, started by torchrun (``run.py`` does it).

The rank imports the ported file once, then for each test forks a child that runs only that
test, with a store of its own (a fresh ``TCPStore`` that rank 0 hosts for the test) so that the
test's process group and symmem's world start from nothing. The parent bounds the child: it is
killed at ``--test-timeout`` seconds, or ``--grace`` seconds after every other rank's child has
finished (a rank left waiting for a peer that failed early). The ranks agree on each step
through the launcher's store. Each rank appends one JSON line per test to ``--out``/rankN.jsonl:
``{"test", "outcome": "pass"|"fail"|"skip", "detail", "seconds"}``.

``worker.py --list FILE...`` prints the test ids of each file (one JSON object), without running
anything.
"""

import argparse
import importlib.util
import json
import os
import select
import signal
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def load(path):
    """Imports the ported file at ``path`` as a module of its own name."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"upstream_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--list", action="store_true", help="print the test ids of the files and exit")
    p.add_argument("--out", help="directory for rankN.jsonl and tests.json")
    p.add_argument("--test-timeout", type=float, default=60.0)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--done", help="file of test ids already recorded (a restart skips them)")
    p.add_argument("-k", dest="keyword", action="append", default=[], help="run only ids containing this")
    p.add_argument("--only", help="file of the test ids to run (one a line)")
    p.add_argument("files", nargs="+")
    args = p.parse_args()

    import harness

    if args.list:
        listed = {}
        for path in args.files:
            listed[os.path.basename(path)] = [
                {"test": tid, "skip": harness.static_skip(t)} for tid, t in harness.collect(load(path))
            ]
        print(json.dumps(listed))
        return
    (path,) = args.files
    tests = harness.collect(load(path))
    if args.keyword:
        tests = [(tid, t) for tid, t in tests if any(k in tid for k in args.keyword)]
    if args.only:
        with open(args.only) as f:
            only = {line.strip() for line in f if line.strip()}
        tests = [(tid, t) for tid, t in tests if tid in only]
    warm_up()
    done = set()
    if args.done and os.path.exists(args.done):
        with open(args.done) as f:
            done = {line.strip() for line in f if line.strip()}
    Rank(args, tests, done).run()


def warm_up():
    """Imports once, in the parent, what a test's first comparison imports (about 2 s of
    torch.distributed.tensor), instead of once per forked test. Single-threaded: nothing here
    starts a thread pool (torchrun sets OMP_NUM_THREADS=1)."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - imported by torch.testing.assert_close

    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


class Rank:
    """This rank's side of the suite: one child per test, in step with the other ranks."""

    def __init__(self, args, tests, done):
        import torch.distributed as dist

        self.args, self.tests, self.done = args, tests, done
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # The launcher's store (torchrun's agent hosts it; every rank is a client).
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.world_size,
            is_master=False,
            timeout=timedelta(seconds=args.test_timeout + 60),
        )
        self.agent = dist.PrefixStore("upstream", agent)
        self.out = open(os.path.join(args.out, f"rank{self.rank}.jsonl"), "a")
        if self.rank == 0:
            with open(os.path.join(args.out, "tests.json"), "w") as f:
                json.dump([tid for tid, _ in tests], f)

    def run(self):
        import harness

        for index, (tid, test) in enumerate(self.tests):
            if tid in self.done:
                continue
            reason = harness.static_skip(test)
            if reason is not None:
                self.record(tid, "skip", reason, 0.0)
                continue
            start = time.monotonic()
            outcome, detail = self.fork(index, test)
            self.record(tid, outcome, detail, time.monotonic() - start)

    def record(self, tid, outcome, detail, seconds):
        line = {"test": tid, "outcome": outcome, "detail": detail, "seconds": round(seconds, 3)}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    def fork(self, index, test):
        """Runs ``test`` in a child process; returns (outcome, detail)."""
        import torch.distributed as dist

        port_r, port_w = os.pipe()
        res_r, res_w = os.pipe()
        store_file = os.path.join(os.environ["UPSTREAM_TMP"], f"store-{index}")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(port_w)
            os.close(res_r)
            child(test, port_r, res_w, store_file)
        os.close(port_r)
        os.close(res_w)
        server = None
        try:
            if self.rank == 0:
                # The test's own store, made after the fork: a forking process holds no
                # server thread.
                server = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
                self.agent.set(f"{index}/port", str(server.port))
                port = server.port
            else:
                port = int(self.agent.get(f"{index}/port"))
            os.write(port_w, f"{port}\n".encode())
        finally:
            os.close(port_w)
        outcome, detail = self.wait(index, pid, res_r)
        # Every rank's child is gone before any rank starts the next test (and before rank 0
        # drops the test's store).
        self.agent.set(f"{index}/done/{self.rank}", outcome)
        self.agent.wait([f"{index}/done/{r}" for r in range(self.world_size)])
        del server
        return outcome, detail

    def wait(self, index, pid, res_r):
        """Waits for the child within its bounds; returns (outcome, detail)."""
        start = time.monotonic()
        others = [f"{index}/done/{r}" for r in range(self.world_size) if r != self.rank]
        others_done_at = None
        killed = None
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                break
            now = time.monotonic()
            if others_done_at is None and (not others or self.agent.check(others)):
                others_done_at = now
            if now - start > self.args.test_timeout:
                killed = f"timeout: still running after {self.args.test_timeout:.0f} s"
            elif others and others_done_at is not None and now - others_done_at > self.args.grace:
                killed = f"hang: still running {self.args.grace:.0f} s after every other rank finished"
            if killed:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        raw = b""
        while select.select([res_r], [], [], 0)[0]:
            chunk = os.read(res_r, 65536)
            if not chunk:
                break
            raw += chunk
        os.close(res_r)
        if raw:
            result = json.loads(raw.decode())
            if result.get("trace"):
                with open(os.path.join(self.args.out, f"trace-rank{self.rank}.txt"), "a") as f:
                    f.write(f"== {index} {result['test']}\n{result['trace']}\n")
            return result["outcome"], result["detail"]
        if killed:
            return "fail", killed
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            # Upstream's tests that leave with os._exit(0) pass under its MultiProcessTestCase.
            return "pass", "exited with status 0 during the test"
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        return "fail", f"the test's process died (status {code}) without a result"


def child(test, port_r, res_w, store_file):
    """The forked child: joins the test's store, runs the test, reports, and exits."""
    code = 0
    try:
        ready, _, _ = select.select([port_r], [], [], 120)
        port = os.read(port_r, 64).decode().strip() if ready else ""
        if not port:
            raise RuntimeError("harness: no store port from the parent")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = port
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        os.environ["UPSTREAM_STORE_FILE"] = store_file
        import harness

        result = harness.run_one(test, store_file)
        report = {
            "test": f"{type(test).__name__}.{test._testMethodName}",
            "outcome": result.outcome,
            "detail": result.detail,
            # Within a pipe's buffer: the parent reads only once the child has exited.
            "trace": result.trace[-32768:],
        }
        del result, test
        os.write(res_w, json.dumps(report).encode())
        os.close(res_w)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the child must never return into the parent's loop
        print(f"upstream worker child: {type(e).__name__}: {e}", file=sys.stderr)
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
