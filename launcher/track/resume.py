"""``python -m launcher.resume RUN_DIR [--wait]``: start an unfinished run again.

Uses the run's own ``config.yaml`` (not a new composition), so the job is the one that
was interrupted; the tasks resume from its newest committed checkpoint. A completed run
is reported, not retrained. Exit 2 on a bad run directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher.checks import already_done, check
from launcher.launch import Point, start
from launcher.track.summary import summary_lines
from slurm.env import expand_hostlist
from spec.config import ConfigError, to_run_config, to_yaml
from spec.rundir import CONFIG, read_run_json, update_run_json


# run.json "failure" values whose suspect_nodes the next allocation avoids.
EXCLUDING_FAILURES = {"node_failure": "node failure", "preflight_outlier": "preflight outlier"}


def exclude_failed_nodes(cfg, run_dir: Path) -> None:
    """After a node failure or a failed preflight, keep the suspect nodes out of the next allocation."""
    info = read_run_json(run_dir)
    reason = EXCLUDING_FAILURES.get(info.get("failure"))
    if reason is None or cfg.cluster.backend != "slurm":
        return
    bad = set(info.get("suspect_nodes", []))
    if not bad:
        return
    current = set(expand_hostlist(cfg.cluster.exclude)) if cfg.cluster.exclude else set()
    cfg.cluster.exclude = ",".join(sorted(current | bad))
    (run_dir / CONFIG).write_text(to_yaml(cfg))
    update_run_json(run_dir, excluded_nodes=sorted(current | bad))
    print(f"excluding {', '.join(sorted(bad))} ({reason} in the last segment)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.resume", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
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
        layout, slurm_conf = check(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reason = already_done(cfg, run_dir, slurm_conf)
    if reason:
        print(f"{reason}; nothing submitted")
        print("\n".join(summary_lines(run_dir)))
        return 0
    point = Point(cfg, layout, run_dir, slurm_conf, label=f"resume {run_dir.name}", overrides=[], multirun=False)
    return start(None, point, wait=args.wait)
