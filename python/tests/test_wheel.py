"""The wheel as a user installs it: built from this checkout, installed into a fresh venv next to
torch, and its ``symmem`` command run from the venv's ``bin``. Also: symmem's logs reach
Python's ``logging``."""

import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest

HERE = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheels = tmp / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--locked", "-q", "-o", str(wheels)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("symmem-*.whl")
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    # "Next to torch": the fresh venv sees this venv's torch through a .pth file, as a user's
    # venv sees its own torch, without installing it again.
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "torch_next_door.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    return env


def clean_env():
    env = dict(os.environ)
    for k in ("SYMMEM_STORE_SECRET", "OMP_NUM_THREADS", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(k, None)
    return env


def test_the_wheel_installs_the_symmem_command(venv):
    exe = venv / "bin" / "symmem"
    assert exe.exists(), "the wheel installs a console script"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    py = venv / "bin" / "python"
    meta = subprocess.run(
        [str(py), "-c", "import symmem; print(symmem.__version__, symmem.__commit__)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    version, commit = meta.stdout.split()
    assert out.stdout.strip() == f"symmem {version} (commit {commit})", (out.stdout, meta.stdout)
    # symmem run from the venv, ranks importing the venv's symmem and the torch next door.
    prog = "import os, symmem, torch; print('rank', os.environ['RANK'], symmem.__file__.startswith(os.environ['V']))"
    env = clean_env()
    env["V"] = str(venv)
    out = subprocess.run(
        [str(exe), "run", "-n", "2", "--", str(py), "-c", prog], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["[0] rank 0 True", "[1] rank 1 True"], out.stdout
    # The notice torchrun prints, through Python's logging, without colour codes in a pipe.
    assert "WARNING symmem.launch: setting OMP_NUM_THREADS=1" in out.stderr, out.stderr
    assert "\x1b[" not in out.stderr
    # A failing rank's exit code comes back through the console script.
    out = subprocess.run(
        [str(exe), "run", "-n", "2", "--", str(py), "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert out.returncode == 3, out.stderr
    assert "rank 1 exited with code 3" in out.stderr


LOGS = textwrap.dedent(
    """
    import logging, threading, time
    from torch.distributed import TCPStore
    import symmem

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelname, record.getMessage()))

    logging.getLogger("symmem").addHandler(Keep())
    logging.getLogger("symmem").setLevel(logging.DEBUG)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = {}
    ts = [threading.Thread(target=lambda r: out.__setitem__(r, symmem.new_transport_rank(
        "tcp", store=store, peer_rank=1 - r, rank=r, bootstrap_timeout=30)), args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    [t.close() for t in out.values()]
    time.sleep(0.5)
    for name, level, message in seen:
        print(name, level, message[:60])
    """
)


@pytest.mark.parametrize("log", [None, "error"])
def test_logs_reach_python_logging_filtered_by_symmem_log(log):
    env = clean_env()
    env.pop("SYMMEM_LOG", None)
    env.pop("SYMMEM_JOB_SECRET", None)
    if log:
        env["SYMMEM_LOG"] = log
    out = subprocess.run([sys.executable, "-c", LOGS], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    warned = [l for l in out.stdout.splitlines() if l.startswith("symmem.store WARNING the job's store")]
    if log is None:
        # The warning about an unauthenticated store, on a child of the `symmem` logger, and
        # not also printed by symmem itself.
        assert warned, out.stdout
        assert "is not authenticated" not in out.stderr, out.stderr
    else:
        assert not warned, out.stdout
