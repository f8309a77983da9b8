"""A rank that fails on rank 1 inside torch's @record, as torchrun's users write them; it
prints the launcher-given environment torchrun's tooling reads. Rank 1 fails only once rank 0
has printed (a file in TMPDIR says so, at most 60 s): a launcher stops the other ranks when one
fails, and torchrun sometimes stopped rank 0 while it was still importing torch."""
import os
import tempfile
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    names = ["OMP_NUM_THREADS", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]
    print("env " + " ".join(f"{n}={os.environ.get(n)}" for n in names)
          + f" run_id={bool(os.environ.get('TORCHELASTIC_RUN_ID'))}"
          + f" error_file={os.environ.get('TORCHELASTIC_ERROR_FILE', '').endswith('error.json')}", flush=True)
    printed = os.path.join(tempfile.gettempdir(), f"rank0-printed-{os.environ['MASTER_PORT']}")
    if os.environ["RANK"] == "0":
        open(printed, "w").close()
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 60
        while not os.path.exists(printed) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("boom on rank 1")


main()
