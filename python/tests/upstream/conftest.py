"""The ported upstream files run under their own harness (run.py, or ../test_upstream.py), one
process per rank per test, never inside pytest's process."""

collect_ignore_glob = ["*.py"]
