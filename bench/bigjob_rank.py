"""One rank of a big job, for real: the ``bigjob/*`` rows of `make gpu-check`
(bench/gpu_check_bigjob.py).

Rank 0 of a 64-node x 8-GPU llama3_70b job under fsdp_tp (world 512: FSDP over 256 ranks,
tensor parallel 2 inside a node), seq 8192, micro-batch 2, full activation checkpointing,
bf16, as ``python -m launcher`` composes it (its dry run writes the run's config.yaml,
which this script reads as the trainer does). It joins torch's fake process group as
rank 0 of 512 (:func:`train.torch_compat.fake_process_group`: every collective answered
locally, no data moved) with its device taken as the harness takes it, then:

- ``affinity``: the rank placed by the harness's own call (train/harness/affinity.py
  ``bind_rank``, binding ``task``: its GPU from torch, the node's other GPUs from sysfs)
  and its CPUs against its GPU's sysfs ``local_cpulist``;
- ``rank``: the trainer's mesh and parallelized model (train/parallelize.py, the
  trainer's own build: only this rank's shards are materialised, on cuda:0), every
  shard's shape against theory (TP's dim split by 2, then FSDP's first dim by 256, rank 0
  taking the rounded-up chunk) and its parameter count against the planner's per-rank
  share; two training steps (``Engine.train_step``) and the second one's peak memory
  (allocated, reserved, and on the device: reserved + what CUDA holds beside the
  allocator) against ``python -m launcher.plan``'s figure for this rank (goal: within
  10%). The collectives move nothing, so the losses are whatever the buffers held
  (garbage, and said so): the shapes, kernels and memory are the real rank's. No NCCL
  communicator exists (the planner's 2 GB of CUDA overhead counts one);
- ``snapshot`` and ``save_load``: the async pinned snapshot of the real shard, the stall,
  then save and load GB/s with checksums (bench/bigjob_save.py says how, and what differs
  from a job).

``--layers N`` (fewer than 80: a step too slow for the time slot) builds N layers and asks
the planner for N layers too; the row says so, with the 80-layer figure beside it.
``--dry`` (CPU, CI): the same code on the same 512-rank layout with a tiny model's shape
(the planner asked for that shape), the affinity on a fake sysfs tree (two NUMA nodes,
eight GPUs): shapes against theory, the steps, the snapshot, the save and load round trip
with its checksums and a flipped byte refused, in a few seconds.

    python bench/bigjob_rank.py rank DIR [--layers 80] [--micro-batch 2] [--dry]
    python bench/bigjob_rank.py show SECTION DIR [--dry]   # SECTION: rank, snapshot, save_load, affinity

``rank`` writes ``DIR/started.json`` at once and ``DIR/result.json`` at its end (every
section reached, or the error); its exit status is the ``rank`` section's verdict. ``show``
waits for that result (the rows may run side by side) and prints one section's line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bigjob_parts import DRY_LAYERS, LAYERS, MICRO_BATCH, SECTIONS  # noqa: E402

NOT_STARTED_S = 30.0  # ``show``: the rank row should have started by then


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def rank_main(out: Path, layers: int, micro_batch: int, dry: bool) -> int:
    """Run the rank (:func:`bench.bigjob_steps.run`), always leaving ``result.json``."""
    from bench.bigjob_steps import run

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "started.json", {"pid": os.getpid(), "time": time.time()})
    result: Dict[str, Any] = {"mode": "dry" if dry else "real", "layers": layers, "micro_batch": micro_batch,
                              "sections": {}}
    try:
        run(out, result, layers, micro_batch, dry)
    except BaseException as exc:  # noqa: BLE001 - recorded for the other rows, then the exit status
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
    finally:
        write_json(out / "result.json", result)
    for name in SECTIONS:
        sec = result["sections"].get(name)
        print(f"{name}: {'ok' if sec and sec['ok'] else 'FAILED'}: {sec['line'] if sec else result.get('error')}")
    return 0 if result["sections"].get("rank", {}).get("ok") else 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_result(out: Path, not_started_s: float = NOT_STARTED_S) -> Tuple[Optional[dict], str]:
    """The rank's result.json once it is there; (None, why) when the rank row never
    started in ``out`` or ended without one."""
    t0 = time.time()
    while True:
        if (out / "result.json").is_file():
            return json.loads((out / "result.json").read_text()), ""
        if (out / "started.json").is_file():
            pid = json.loads((out / "started.json").read_text())["pid"]
            if not _alive(pid) and not (out / "result.json").is_file():
                return None, f"bigjob/rank (pid {pid}) ended without a result in {out}"
        elif time.time() - t0 > not_started_s:
            return None, f"bigjob/rank has not started in {out} (select it too: --only bigjob)"
        time.sleep(0.5)


def show(section: str, out: Path) -> int:
    result, why = wait_result(out)
    sec = (result or {}).get("sections", {}).get(section)
    if sec is None:
        print(f"{section}: not reached: {why or (result or {}).get('error', 'no such section')}")
        return 1
    print(json.dumps(sec.get("facts", {}), indent=1, default=str))
    print(f"{section}: {sec['line']}")
    return 0 if sec["ok"] else 1


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["rank", "show"])
    ap.add_argument("args", nargs="+", help="rank: DIR; show: SECTION DIR")
    ap.add_argument("--layers", type=int, default=None, help=f"default {LAYERS} ({DRY_LAYERS} with --dry)")
    ap.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    ap.add_argument("--dry", action="store_true", help="CPU: the same code on a tiny model's shape")
    args = ap.parse_args(argv)
    if args.what == "show":
        if len(args.args) != 2 or args.args[0] not in SECTIONS:
            ap.error(f"show SECTION DIR, SECTION one of {', '.join(SECTIONS)}")
        return show(args.args[0], Path(args.args[1]))
    layers = args.layers or (DRY_LAYERS if args.dry else LAYERS)
    return rank_main(Path(args.args[0]), layers, args.micro_batch, args.dry)


if __name__ == "__main__":
    sys.exit(main())
