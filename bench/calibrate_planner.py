"""The planner's GPU constants implied by a `make gpu-check` run's speed rows.

    python bench/calibrate_planner.py SCRATCH [--table OUT/gpu_check.jsonl] [--json PATH]

SCRATCH is the run's scratch folder (``--scratch``, else the one bench/gpu_check.py
prints on its first line). It reads what the speed rows left there: each
``speed_*/speed.json`` (bench/gpu_check_speed.py: the measured medians of the steps after
the fifth beside the planner's JSON object for the same run) and each
``speed_loss_*/loss.json`` (bench/chunked_loss.py ``--gpu``); with ``--table`` only the
rows that passed. It prints, for each constant of the planner's GPU model, the value
those rows imply, the value in the source now, and the rows it came from:

- ``MFU`` (launcher/plan/costmodel.py): the planner's step on one GPU is its compute alone
  (no collective at world 1), FLOPs / (peak x MFU), so the MFU that predicts the measured
  step is MFU x planned / measured step. From the eager rows (``strategy.compile`` is off
  by default), the median, rounded down; the compiled rows' figures are shown beside it.
- ``FRAGMENTATION`` (launcher/plan/memory.py): the caching allocator's reserved peak over
  its allocated peak, less one; the largest over the rows, rounded up.
- ``CUDA_OVERHEAD`` (launcher/plan/memory.py): the GPU memory a process holds outside the
  caching allocator (the CUDA context, cuBLAS, a one-rank NCCL group), measured by the
  loss rows; the largest, rounded up to 0.1 GB.

Beside them, per speed row, the planner's model states + activations + buffers over the
allocated peak: a check of its formulas (launcher/plan/states.py, activations.py), not a
constant. Nothing is edited: the lines say what to change and why. Pure Python (no torch).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from pathlib import Path
from statistics import median
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
WHERE = {"MFU": "launcher/plan/costmodel.py", "CUDA_OVERHEAD": "launcher/plan/memory.py",
         "FRAGMENTATION": "launcher/plan/memory.py"}


def planner_constants(repo: Path = REPO) -> Dict[str, float]:
    """The constants' values in the planner's source now (read, not imported: no config stack)."""
    out: Dict[str, float] = {}
    for name, rel in WHERE.items():
        for node in ast.parse((repo / rel).read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                out[name] = float(ast.literal_eval(node.value))
    return out


def passed_rows(table: Path) -> set:
    """The rows that passed in a gpu_check.jsonl."""
    rows = [json.loads(line) for line in table.read_text().splitlines() if line.strip()]
    return {r["row"] for r in rows if r.get("result") == "pass"}


def load(scratch: Path, table: Optional[Path] = None) -> Dict[str, List[dict]]:
    """The speed rows' speed.json and the loss rows' loss.json under ``scratch`` (with
    ``table``: of the rows that passed there), each with its row's name."""
    keep = passed_rows(table) if table else None
    speeds = [json.loads(p.read_text()) for p in sorted(scratch.glob("speed_*/speed.json"))]
    losses = []
    for path in sorted(scratch.glob("speed_loss_*/loss.json")):
        losses.append({**json.loads(path.read_text()), "row": "speed/" + path.parent.name[len("speed_"):]})
    if keep is not None:
        speeds, losses = [s for s in speeds if s["row"] in keep], [x for x in losses if x["row"] in keep]
    return {"speed": speeds, "loss": losses}


def _mfu(speeds: List[dict]) -> Optional[dict]:
    implied = {}
    for s in speeds:
        plan, got, assumed = s["plan"], s["measured"], s["assumed"]["MFU"]
        if plan.get("step_s") and got.get("step_s") and abs((plan.get("mfu") or 0) - assumed) < 1e-3:
            implied[s["row"]] = assumed * plan["step_s"] / got["step_s"]  # compute-only plans (world 1)
    eager = {row: v for row, v in implied.items() if "+compile" not in row}
    if not implied:
        return None
    chosen = eager or implied
    value = math.floor(100 * median(chosen.values())) / 100
    others = {row: v for row, v in implied.items() if row not in chosen}
    return {"value": value, "sources": chosen, "beside": others,
            "how": "median of the eager rows (planned / measured step x the MFU assumed)" if eager
            else "median of the rows (none eager)"}


def _fragmentation(speeds: List[dict]) -> Optional[dict]:
    share = {s["row"]: s["measured"]["peak_reserved_bytes"] / s["measured"]["peak_bytes"] - 1
             for s in speeds if s["measured"].get("peak_reserved_bytes") and s["measured"].get("peak_bytes")}
    if not share:
        return None
    return {"value": math.ceil(100 * max(0.0, max(share.values()))) / 100, "sources": share, "beside": {},
            "how": "the largest reserved / allocated peak - 1"}


def _overhead(losses: List[dict]) -> Optional[dict]:
    outside = {x["row"]: float(x["outside_allocator_bytes"]) for x in losses if x.get("outside_allocator_bytes")}
    if not outside:
        return None
    return {"value": math.ceil(max(outside.values()) / 1e8) * 1e8, "sources": outside, "beside": {},
            "how": "the largest memory outside the caching allocator (one rank's NCCL group)"}


def formulas(speeds: List[dict]) -> Dict[str, float]:
    """Per speed row: the planner's states + activations + buffers over the allocated peak."""
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "buffer_bytes")
    return {s["row"]: sum(s["plan"].get(k) or 0 for k in keys) / s["measured"]["peak_bytes"]
            for s in speeds if s["measured"].get("peak_bytes") and all(k in s["plan"] for k in keys)}


def calibrate(found: Dict[str, List[dict]], current: Dict[str, float]) -> Dict[str, dict]:
    """Constant -> {value, now, file, how, sources: {row: figure}, beside: {row: figure}}."""
    out = {}
    for name, got in (("MFU", _mfu(found["speed"])), ("FRAGMENTATION", _fragmentation(found["speed"])),
                      ("CUDA_OVERHEAD", _overhead(found["loss"]))):
        if got:
            out[name] = {**got, "now": current.get(name), "file": WHERE[name]}
    return out


def _figure(name: str, value: float) -> str:
    return f"{value / 1e9:.2f} GB" if name == "CUDA_OVERHEAD" else f"{value:.3f}"


def render(result: Dict[str, dict], checks: Dict[str, float]) -> List[str]:
    lines = []
    for name, c in result.items():
        value = f"{c['value']:.1e}" if name == "CUDA_OVERHEAD" else f"{c['value']:.2f}"
        now = f"{c['now']:.1e}" if name == "CUDA_OVERHEAD" else f"{c['now']:.2f}"
        rows = ", ".join(f"{row} {_figure(name, v)}" for row, v in c["sources"].items())
        beside = "; beside: " + ", ".join(f"{row} {_figure(name, v)}" for row, v in c["beside"].items()) \
            if c["beside"] else ""
        lines.append(f"{c['file']}: {name} = {value}  # now {now}; {c['how']}: {rows}{beside}")
    if checks:
        lines.append("planned states + activations + buffers / allocated peak (the formulas, not a constant): "
                     + ", ".join(f"{row} {v:.2f}" for row, v in checks.items()))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scratch", help="the gpu-check run's scratch folder (its speed_* run directories)")
    p.add_argument("--table", default=None, help="its gpu_check.jsonl: only the rows that passed there")
    p.add_argument("--json", default=None, help="also write the constants and their sources here")
    args = p.parse_args(argv)
    found = load(Path(args.scratch), Path(args.table) if args.table else None)
    result, checks = calibrate(found, planner_constants()), formulas(found["speed"])
    if not result:
        print(f"{args.scratch}: no speed row's speed.json nor loss row's loss.json (did `--only speed` run there?)")
        return 1
    print("\n".join(render(result, checks)))
    if args.json:
        Path(args.json).write_text(json.dumps({"constants": result, "formulas": checks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
