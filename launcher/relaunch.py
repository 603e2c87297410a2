"""``python -m launcher.resume RUN_DIR [KEY=VALUE ...] [--wait]``: start an unfinished run again.

Uses the run's own ``config.yaml`` (not a new composition), so the job is the one that
was interrupted; the tasks resume from its newest committed checkpoint. A completed run
is reported, not retrained. Exit 2 on a bad run directory. The job imports the code the
run froze at submission (launcher/snapshot.py) unless ``launcher.snapshot=refresh``
freezes the checkout as it is now (``launcher.snapshot=false``: the checkout, unfrozen).

Overrides after RUN_DIR (Hydra's ``key=value``, and ``strategy=NAME`` for a strategy
profile) apply to the saved config: ``cluster.nodes=1``, ``cluster.gpus_per_node=4``,
``strategy=fsdp`` resume the checkpoint on another shape (README: "Resume on another
shape"); ``launcher.wait=true`` waits as ``--wait`` does. What the checkpoint cannot
continue is refused with one line (exit 2, nothing written or submitted): the model,
the data stream (``data.*``, ``train.seq_len``), a switch between the torch engine and DeepSpeed, and a change to or from DeepSpeed's stage
0. The torch strategies reshape freely (data, tensor and pipeline degrees: DCP); ZeRO
stages 1-3 convert into each other through DeepSpeed's universal checkpoint. When the
data-parallel degree changes and neither
``train.micro_batch_size`` nor ``train.grad_accum`` is given, the global batch is kept
(the new degree must divide it): the per-rank share is split into micro-batch x
accumulation anew. The new shape goes through the launcher's checks (layout rules, the
memory planner) before anything is written; run.json's ``reshaped`` lists each change
(``from``, ``to``, ``at_step``). ``launcher.dry_run=true`` prints the new shape's job and
rank map and changes nothing. A DeepSpeed checkpoint that must go through the universal
format is converted before the training job, by a CPU job it follows on Slurm, or before
the ranks start locally (:mod:`train.checkpoint.convert`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

from launcher import snapshot
from launcher.checks import already_done, check
from launcher.launch import Point, dry_run, freeze_code, start
from launcher.track.resume import conversion_stage, exclude_failed_nodes, record_reshape, reshape
from launcher.track.summary import summary_lines
from spec.config import ConfigError, RunConfig, to_run_config
from spec.rundir import CONFIG


def _refused(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.resume", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="changes to the saved config, e.g. cluster.nodes=1 (resume on another shape)")
    parser.add_argument("--wait", action="store_true", help="block until the job ends and print its summary")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if not (run_dir / CONFIG).is_file():
        print(f"error: RUN_DIR={run_dir}: no {CONFIG} there; pass a run directory made by `python -m launcher`",
              file=sys.stderr)
        return 2
    try:
        cfg = to_run_config(run_dir / CONFIG)
        exclude_failed_nodes(cfg, run_dir)
        new, notes = reshape(cfg, args.overrides) if args.overrides else (cfg, [])
        layout, slurm_conf, saves = check(new)
        entry, code, kept = snapshot.resume_code(run_dir, new, args.overrides)
    except ConfigError as exc:
        return _refused(exc)
    reason = already_done(new, run_dir, slurm_conf)
    if reason:
        print(f"{reason}; nothing submitted")
        print("\n".join(summary_lines(run_dir)))
        return 0
    for line in notes:
        print(line)
    point = Point(new, layout, run_dir, slurm_conf, label=f"resume {run_dir.name}", overrides=[], multirun=False,
                  entry=entry, code=code, frozen=kept, saves=saves)
    convert = conversion_stage(run_dir, new)
    if new.launcher.dry_run:  # the new shape's script and rank map; the run directory keeps its config
        if convert is not None:
            print(f"would first convert the newest checkpoint to DeepSpeed's universal format for ZeRO stage "
                  f"{convert} ({'a CPU job the training job follows' if cfg.cluster.backend == 'slurm' else 'here'})")
        return dry_run(point)
    if args.overrides:
        record_reshape(run_dir, cfg, new, args.overrides)
    if kept is None:  # frozen anew (launcher.snapshot=refresh, or none kept), or the checkout
        freeze_code(point)
    return start(None, point, wait=wait_asked(args.wait, args.overrides, new), convert=convert)


def wait_asked(flag: bool, overrides: List[str], new: RunConfig) -> bool:
    """``--wait``, or ``launcher.wait=true`` among this resume's overrides (as ``python -m
    launcher`` takes it). The saved config's value, the launch's, is not this command's ask."""
    given = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    return flag or ("launcher.wait" in given and new.launcher.wait)
