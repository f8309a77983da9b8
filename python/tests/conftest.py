"""Session-wide setup: every child process a test starts (torchrun above all, which leaves a
`torchelastic_*` log directory behind in the temporary directory on every launch) gets a
temporary directory of this session's own, removed when the session ends, so no test leaves
files behind."""

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir():
    old = os.environ.get("TMPDIR")
    tmp = tempfile.mkdtemp(prefix="symmem-pytest-")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        yield tmp
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None
        shutil.rmtree(tmp, ignore_errors=True)
