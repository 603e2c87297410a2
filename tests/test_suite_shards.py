"""`--shard K/N` (tests/conftest.py), as tests/run_suite.sh uses it: every selected test
runs in exactly one part, whole files stay together, and the parts are balanced."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DURATIONS, REPO, shard_files, shard_select


def test_files_are_dealt_heaviest_first_to_the_lightest_part():
    weights = {"a": 9.0, "b": 5.0, "c": 4.0, "d": 3.0, "e": 1.0}
    parts = shard_files(weights, 2)
    assert parts == [["a", "d"], ["b", "c", "e"]]  # 12 against 10 (a greedy deal; the best is 11/11)
    assert sorted(sum(parts, [])) == sorted(weights)
    assert shard_files(weights, 2) == parts  # the same on every call (and machine)


# pytest's collection, once per argument list, in one process: the test modules (torch
# among their imports: ~15 s of CPU a collection) are imported by the first only.
COLLECT = """
import contextlib, io, json, sys
import pytest
runs = {}
for key, args in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args])
    ids = sorted(line for line in out.getvalue().splitlines() if "::" in line)
    runs[key] = {"ids": ids, "code": int(code), "output": out.getvalue() + err.getvalue()}
print(json.dumps(runs))
"""
RUNS = {"every": ["-m", "slurm"], "whole": ["-m", "slurm_whole"], "bad": ["--shard=3/2"],
        **{f"part{k}": ["-m", "slurm and not slurm_whole", f"--shard={k}/2"] for k in (1, 2)},
        "others": ["-m", "not slurm"], **{f"other{k}": ["-m", "not slurm", f"--shard={k}/2"] for k in (1, 2)}}


@pytest.fixture(scope="module")
def collections(request) -> dict:
    """Each run's test ids. Within the suite (every test file collected: tests/run_suite.sh's
    runs), from the suite's own collection and markers (tests/conftest.py ``_Collected``)
    through the very selection ``--shard`` applies (``shard_select``): no second collection
    of the suite (~27 CPU-s). Alone, pytest collects each run in a subprocess."""
    marks = getattr(request.config, "sto_marks", {})
    files = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    if not files <= {i.split("::", 1)[0] for i in marks}:
        proc = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(RUNS)], cwd=REPO, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])
    known = json.loads(DURATIONS.read_text())
    ids = sorted(marks)
    slurm = [i for i in ids if "slurm" in marks[i]]
    pairs = [i for i in slurm if "slurm_whole" not in marks[i]]
    others = [i for i in ids if "slurm" not in marks[i]]
    runs = {"every": slurm, "whole": [i for i in slurm if "slurm_whole" in marks[i]], "others": others,
            **{f"part{k}": shard_select(pairs, k, 2, known) for k in (1, 2)},
            **{f"other{k}": shard_select(others, k, 2, known) for k in (1, 2)}}
    bad = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "--shard=3/2", "tests/test_provenance.py"], cwd=REPO, capture_output=True, text=True)
    return {**{key: {"ids": sorted(v)} for key, v in runs.items()},
            "bad": {"code": bad.returncode, "output": bad.stdout + bad.stderr}}


def test_the_slurm_runs_split_the_slurm_tests_exactly(collections):
    every, whole = collections["every"]["ids"], collections["whole"]["ids"]
    parts = [collections[f"part{k}"]["ids"] for k in (1, 2)]
    assert every and all(parts) and whole
    assert sorted(parts[0] + parts[1] + whole) == every
    files = [{t.split("::")[0] for t in part} for part in parts]
    assert not files[0] & files[1]  # a file's module fixtures are built in one run only


def test_the_runs_without_slurm_split_the_other_tests_exactly(collections):
    every = collections["others"]["ids"]
    parts = [collections[f"other{k}"]["ids"] for k in (1, 2)]
    assert every and all(parts) and sorted(parts[0] + parts[1]) == every
    files = [{t.split("::")[0] for t in part} for part in parts]
    assert not files[0] & files[1]


def test_a_bad_shard_is_refused(collections):
    bad = collections["bad"]
    assert bad["code"] != 0 and "--shard=3/2: expected K/N" in bad["output"]


def test_durations_are_read_from_a_durations_run():
    """tests/durations.py sums each test's setup, call and teardown from ``--durations=0``."""
    from durations import seconds

    log = ["============================= slowest durations ==============================",
           "12.50s setup    tests/test_a.py::test_one[x-1]",
           "3.25s call     tests/test_a.py::test_one[x-1]",
           "0.01s teardown tests/test_a.py::test_one[x-1]",
           "2.00s call     tests/test_b.py::test_two",
           "(3 durations < 0.005s hidden.  Use -vv to show these durations.)"]
    assert seconds(log) == {"tests/test_a.py::test_one[x-1]": 15.76, "tests/test_b.py::test_two": 2.0}
