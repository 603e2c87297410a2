"""`--shard K/N` (tests/conftest.py), as tests/run_suite.sh uses it: every selected test
runs in exactly one part, whole files stay together, and the parts are balanced."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO, shard_files


def test_files_are_dealt_heaviest_first_to_the_lightest_part():
    weights = {"a": 9.0, "b": 5.0, "c": 4.0, "d": 3.0, "e": 1.0}
    parts = shard_files(weights, 2)
    assert parts == [["a", "d"], ["b", "c", "e"]]  # 12 against 10 (a greedy deal; the best is 11/11)
    assert sorted(sum(parts, [])) == sorted(weights)
    assert shard_files(weights, 2) == parts  # the same on every call (and machine)


def _collect(*args: str) -> list:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO, capture_output=True, text=True).stdout
    return sorted(line for line in out.splitlines() if "::" in line)


def test_the_slurm_runs_split_the_slurm_tests_exactly():
    every = _collect("-m", "slurm")
    parts = [_collect("-m", "slurm and not slurm_whole", f"--shard={k}/2") for k in (1, 2)]
    whole = _collect("-m", "slurm_whole")
    assert every and all(parts) and whole
    assert sorted(parts[0] + parts[1] + whole) == every
    files = [{t.split("::")[0] for t in part} for part in parts]
    assert not files[0] & files[1]  # a file's module fixtures are built in one run only


def test_a_bad_shard_is_refused():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--shard=3/2"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "--shard=3/2: expected K/N" in proc.stderr + proc.stdout
