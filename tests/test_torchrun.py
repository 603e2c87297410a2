"""Every strategy also runs under torchrun (the same ``python -m train RUN_DIR`` entrypoint
that Slurm tasks run), not only through the launcher: 2 ranks (pp_fsdp_tp: 4), 3 steps."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, launcher, run_dir_of
from helpers import strategy_options
from launcher.local import free_port
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow
RANKS = {"pp_fsdp_tp": 4}  # pp 2 x tp 2


@pytest.mark.parametrize("strategy", strategy_options())
def test_strategy_under_torchrun(tmp_path, strategy):
    ranks = RANKS.get(strategy, 2)
    prep = launcher([f"+strategy={strategy}", f"cluster.gpus_per_node={ranks}", "train.steps=3", "train.seq_len=32",
                     "data.num_tokens=50000", f"data.cache_dir={tmp_path}/d", "launcher.dry_run=true"], cwd=tmp_path)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    run_dir = run_dir_of(prep.stdout)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run([torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), "-m", "train",
                           str(run_dir)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["launcher"] == "torchrun", info
    assert info["world_size"] == ranks and info["strategy"] == strategy
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
