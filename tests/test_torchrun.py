"""The strategies also run under torchrun (the same ``python -m train RUN_DIR`` entrypoint
that Slurm tasks run), not only through the launcher: 2 ranks (pp_fsdp_tp: 4), 3 steps.

What torchrun changes is the ranks' start (no fork, each its own imports) and their
environment (torchrun's variables, not Slurm's), which the engines read: one strategy of
each engine, torch's (pipeline, tensor parallel and FSDP at once) and DeepSpeed's (ZeRO-3
with CPU offload); DDP under torchrun is tests/test_ddp.py's. Every way a rank is built
started cold, one process each, is tests/test_e2e_slurm.py's (its ACROSS_NODES, checked
with :func:`_paths`), and every strategy's training tests/test_strategies.py's."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_dir_of
from warm import pythonpath
from helpers import compose_run, strategy_options
import warm  # the dry run that writes the run directory: forked warm (tests/warm.py)
from launcher.local import free_port
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow
RANKS = {"pp_fsdp_tp": 4}  # pp 2 x tp 2
STRATEGIES = ["pp_fsdp_tp", "zero3_offload"]


def _paths(strategy: str) -> set:
    """What of the rank's code a strategy takes that the environment could reach."""
    from spec.layout import build_layout
    from spec.support import BUILDERS, builder_key

    cfg = compose_run([f"+strategy={strategy}", f"cluster.gpus_per_node={RANKS.get(strategy, 2)}"])
    layout, s = build_layout(cfg), cfg.strategy
    zero = {0: "", 1: "zero1-2", 2: "zero1-2", 3: "zero3"}[s.zero_stage] if s.engine == "deepspeed" else ""
    return {BUILDERS[builder_key(cfg)], "pp" if layout.pp > 1 else "", "tp" if layout.tp_enabled else "", zero,
            "offload" if s.offload_optimizer else ""} - {""}


def test_the_strategies_run_take_each_engine():
    engines = {compose_run([f"+strategy={s}"]).strategy.engine for s in STRATEGIES}
    assert engines == {compose_run([f"+strategy={s}"]).strategy.engine for s in strategy_options()}, engines
    assert {"pp", "tp", "offload"} <= set().union(*(_paths(s) for s in STRATEGIES))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_under_torchrun(tmp_path, strategy):
    ranks = RANKS.get(strategy, 2)
    prep = warm.launcher([f"+strategy={strategy}", f"cluster.gpus_per_node={ranks}", "train.steps=3", "train.seq_len=32",
                     "data.num_tokens=50000", f"data.cache_dir={tmp_path}/d", "launcher.dry_run=true"], cwd=tmp_path)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    run_dir = run_dir_of(prep.stdout)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = dict(os.environ, PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run([torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), "-m", "train",
                           str(run_dir)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["launcher"] == "torchrun", info
    assert info["world_size"] == ranks and info["strategy"] == strategy
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
