"""No call into symmem's native module raises PyO3's PanicException (issue 51, item 3): a
BaseException, which `except Exception` does not catch, and a rank that raised it left its
group out of step. Every entry point catches panics, and a panic (a bug) raises RuntimeError."""

import os
import re

import pytest

from symmem import _native

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.mark.parametrize("released", [False, True], ids=["holding-the-gil", "gil-released"])
def test_a_panic_raises_runtime_error(released):
    with pytest.raises(RuntimeError, match=r"internal error.*_panic_for_test"):
        _native._panic_for_test(released)


def test_every_entry_point_catches_panics():
    # `#[catch_panics]` goes above every #[pyfunction], #[pymodule] and #[pymethods] impl (its
    # macro refuses to go below them), so a new entry point without it fails here.
    if not os.path.isdir(SRC):
        pytest.skip("the extension's sources are not beside the tests")
    entries = 0
    for name in sorted(os.listdir(SRC)):
        if not name.endswith(".rs"):
            continue
        lines = open(os.path.join(SRC, name)).read().splitlines()
        for i, line in enumerate(lines):
            if re.fullmatch(r"\s*#\[(pyfunction|pymodule|pymethods)\]\s*", line):
                entries += 1
                assert i > 0 and lines[i - 1].strip() == "#[catch_panics]", f"{name}:{i + 1} lacks #[catch_panics]"
    assert entries > 50, entries
