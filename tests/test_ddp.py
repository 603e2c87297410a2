"""Tier 3: DDP on 2 gloo ranks equals one process on the same global batch; torchrun works.

The first test starts the launcher and its ranks as a user does (``python -m launcher``,
rank 0 ``python -m train``); the others fork them from one process that imported torch
once (tests/warm.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import warm
from conftest import REPO, launcher, run_dir_of
from warm import pythonpath
from launcher.local import free_port
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow
COMMON = ["train.steps=5", "train.seq_len=32", "data.num_tokens=50000"]


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def test_two_ranks_match_one_process(tmp_path):
    two = launcher(COMMON + ["cluster.gpus_per_node=2", "train.micro_batch_size=4",
                             f"data.cache_dir={tmp_path}/data"], cwd=tmp_path, cold=True)  # the real start-up
    one = launcher(COMMON + ["cluster.gpus_per_node=1", "train.micro_batch_size=8",
                             f"data.cache_dir={tmp_path}/data"], cwd=tmp_path, cold=True)
    assert two.returncode == 0 and one.returncode == 0, two.stdout + two.stderr + one.stderr
    l2, l1 = _losses(run_dir_of(two.stdout)), _losses(run_dir_of(one.stdout))
    assert len(l1) == len(l2) == 5
    for a, b in zip(l1, l2):
        assert abs(a - b) <= 1e-5 * abs(a), (l1, l2)
    assert l1[-1] < l1[0]
    info = read_run_json(run_dir_of(two.stdout))
    assert info["status"] == "completed" and info["world_size"] == 2
    assert info["matmul"] == "fp32"  # IEEE on CPU whatever strategy.tf32 says (tests/test_attention.py)


def test_accumulation_matches_a_larger_micro_batch(tmp_path):
    acc = warm.launcher(COMMON + ["train.micro_batch_size=2", "train.grad_accum=2", f"data.cache_dir={tmp_path}/d"],
                   cwd=tmp_path)
    big = warm.launcher(COMMON + ["train.micro_batch_size=4", f"data.cache_dir={tmp_path}/d"], cwd=tmp_path)
    assert acc.returncode == 0 and big.returncode == 0, acc.stderr + big.stderr
    for a, b in zip(_losses(run_dir_of(acc.stdout)), _losses(run_dir_of(big.stdout))):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_same_entrypoint_under_torchrun_and_alone(tmp_path):
    prep = warm.launcher(COMMON + ["launcher.dry_run=true", f"data.cache_dir={tmp_path}/d"], cwd=tmp_path)
    run_dir = run_dir_of(prep.stdout)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = dict(os.environ, PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1")
    port = str(free_port())  # torchrun hands "--master-port 0" to the workers as port 0
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", port, "-m", "train", str(run_dir)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["launcher"] == "torchrun" and info["world_size"] == 2
    # A single process is a world of one: the config asks for 2 ranks, so it refuses clearly.
    alone = subprocess.run([sys.executable, "-m", "train", str(run_dir)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode != 0 and "the job has 1 ranks but the layout needs 2" in alone.stderr
    # ... and a config of one rank runs as a plain process: no launcher, no torchrun, no Slurm.
    prep1 = warm.launcher(COMMON + ["cluster.gpus_per_node=1", "launcher.dry_run=true", f"data.cache_dir={tmp_path}/d"],
                     cwd=tmp_path)
    one = run_dir_of(prep1.stdout)
    plain = subprocess.run([sys.executable, "-m", "train", str(one)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    info = read_run_json(one)
    assert info["status"] == "completed" and info["world_size"] == 1 and len(read_metrics(one)) == 5


def test_scheduled_garbage_collection_changes_nothing(tmp_path):
    """train.gc_every_steps (automatic GC off, a young collection every N steps) is a
    speed setting only: the same losses, bitwise, as Python's automatic collection."""
    runs = [warm.launcher(COMMON + [f"train.gc_every_steps={n}", f"data.cache_dir={tmp_path}/d"], cwd=tmp_path)
            for n in (2, 0)]
    assert all(r.returncode == 0 for r in runs), "".join(r.stdout + r.stderr for r in runs)
    scheduled, automatic = (_losses(run_dir_of(r.stdout)) for r in runs)
    assert len(scheduled) == 5 and scheduled == automatic
