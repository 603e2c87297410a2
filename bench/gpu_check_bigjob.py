"""The ``bigjob/*`` rows of `make gpu-check` (bench/gpu_check.py): one rank of a big job,
for real (bench/bigjob_rank.py says what and how).

Rank 0 of a 64-node x 8-GPU llama3_70b fsdp_tp job (world 512), seq 8192, micro-batch 2,
full activation checkpointing, on torch's fake process group with real CUDA tensors:

- ``bigjob/rank``: the trainer's build of its shards (their shapes against theory, their
  parameters against the planner's share), two steps, and the second one's peak memory
  against ``python -m launcher.plan``'s figure for that rank (goal: within 10%);
- ``bigjob/snapshot``: the async pinned snapshot of its real shard (pinned bytes, the
  stall: the save's start plus the next step's wait for the copy);
- ``bigjob/save_load``: that shard saved and loaded (GB/s) with the toolkit's writer and
  reader, CRC32s checked, the loaded state equal to the snapshot, a flipped byte refused;
- ``bigjob/affinity``: the rank's CPUs, placed as the harness places them, against its
  GPU's sysfs ``local_cpulist``.

One process (``bigjob/rank``) measures everything; the other three rows wait for its
result and show their part (so they may run beside it). ``--only bigjob`` runs the
group: about two minutes on one H100 or H200 (expected, not yet run there).
``STO_BIGJOB_ARGS`` adds options to the rank's command (``"--layers 20"``: fewer layers,
the planner asked for as many, if a step is too slow for the slot; ``"--micro-batch 4"``).
Under ``--dry`` the same code runs on CPU with a tiny model's shape (a few seconds).
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import List

from bench.gpu_check_runner import Row, exited_ok

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "bigjob_rank.py"
RANK_TIMEOUT_S = 420.0  # build + 3 steps of ~10 s + 1.7 GB saved and loaded: ~2 min expected
_RUNS = itertools.count()


def section(name: str):
    """A row's table detail: its section's line in the rank's result.json."""
    def report(row: Row) -> str:
        result = json.loads((row.run_dir / "result.json").read_text())
        return result["sections"][name]["line"]
    return report


def rows(scratch: Path) -> List[Row]:
    """The group's rows; their own directory for each call (a reused ``--scratch`` never
    shows an earlier run's result)."""
    out = scratch / f"bigjob_{time.strftime('%H%M%S')}_{os.getpid()}_{next(_RUNS)}"
    device = {"CUDA_VISIBLE_DEVICES": os.environ.get("STO_GPU_CHECK_DEVICE", "0")}  # binding task: one GPU
    extra = shlex.split(os.environ.get("STO_BIGJOB_ARGS", ""))  # e.g. "--layers 20": bench/bigjob_rank.py's options
    rank = Row("bigjob/rank", [sys.executable, str(SCRIPT), "rank", str(out), *extra], exited_ok, env=device,
               launch=False, timeout_s=RANK_TIMEOUT_S, run_dir=out, report=section("rank"))
    shown = [Row(f"bigjob/{name}", [sys.executable, str(SCRIPT), "show", name, str(out)], exited_ok, launch=False,
                 timeout_s=RANK_TIMEOUT_S + 30, run_dir=out, report=section(name))
             for name in ("snapshot", "save_load", "affinity")]
    return [rank, *shown]
