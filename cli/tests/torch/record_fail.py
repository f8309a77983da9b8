"""A rank that fails on rank 1 inside torch's @record, as torchrun's users write them; it
prints the launcher-given environment torchrun's tooling reads."""
import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    names = ["OMP_NUM_THREADS", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]
    print("env " + " ".join(f"{n}={os.environ.get(n)}" for n in names)
          + f" run_id={bool(os.environ.get('TORCHELASTIC_RUN_ID'))}"
          + f" error_file={os.environ.get('TORCHELASTIC_ERROR_FILE', '').endswith('error.json')}", flush=True)
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom on rank 1")


main()
