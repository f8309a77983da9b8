"""The wheel's ``symmem`` command: the same CLI as the Rust binary, run from the extension.

Ranks, guards and benchmark jobs the command starts are this same console script again.
symmem's logs go through Python's ``logging`` here; ``SYMMEM_LOG`` chooses what is sent and
this entry point prints it to stderr.
"""

import logging
import os
import shutil
import sys


def main() -> None:
    from . import _native

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("symmem")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)  # SYMMEM_LOG has already chosen what reaches Python
    log.propagate = False
    exe = shutil.which(sys.argv[0]) or os.path.abspath(sys.argv[0])
    argv = ["symmem", *sys.argv[1:]]
    sys.exit(_native.cli_main(argv, exe))


if __name__ == "__main__":
    main()
