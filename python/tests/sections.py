"""The sections of a torchrun worker script (``*_worker.py``): each decorated function runs at
once; its failure is recorded in ``failed`` and printed with its traceback, and the ranks line
up again (``dist.barrier``) before the next, so one failing section hides none of the others.
The worker reports ``failed`` at its end."""

import traceback

import torch.distributed as dist

failed = []


def section(name):
    """Runs the decorated section at once, records its failure, and lines the ranks up again."""

    def run(body):
        try:
            body()
        except Exception:  # noqa: BLE001 - every failure is reported at the end
            failed.append(name)
            print(f"FAILED {name} (rank {dist.get_rank()}):\n{traceback.format_exc()}", flush=True)
        dist.barrier()

    return run
