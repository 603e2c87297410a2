"""One point of a launch: config -> checks -> run directory -> dry run | local | Slurm.

Hydra calls :func:`run_point` once per point (once without ``-m``). Each point
returns at once after submission; ``launcher.wait=true`` waits (for a sweep: for all
points, after the last submission, see ``launcher.__main__``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from launcher import local, registry, submit
from launcher.rundir import write_provenance
from launcher.summary import summary_lines
from slurm import query
from train.config import ConfigError, RunConfig, to_run_config, to_yaml, validate
from train.layout import Layout, build_layout
from train.rundir import CONFIG, read_run_json, update_run_json
from train.strategies import check_supported


@dataclass
class LaunchState:
    """What the points of this invocation did (read by __main__ after a sweep)."""

    submitted: List[Tuple[str, Path, Optional[str]]] = field(default_factory=list)  # job id, run dir, conf
    skipped: List[str] = field(default_factory=list)
    exit_code: int = 0


STATE = LaunchState()


def run_config(dcfg) -> RunConfig:
    """Hydra's composed config -> RunConfig dataclasses.

    conf/config.yaml is built on the registered ``run_schema``, so Hydra's DictConfig is
    already typed and checked field by field: ``to_object`` builds the dataclasses at once
    (~1.5 ms). ``to_run_config`` merges a fresh structured schema first (~40 ms a point);
    it stays for YAML files and untyped mappings.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_config(dcfg) and OmegaConf.get_type(dcfg) is RunConfig:
        obj = OmegaConf.to_object(dcfg)
        if isinstance(obj, RunConfig):
            return obj
    return to_run_config(dcfg)


def check(cfg: RunConfig) -> Tuple[Layout, Optional[str]]:
    """Every check that needs no submission; returns the layout and the slurm.conf to use."""
    validate(cfg)
    layout = build_layout(cfg)
    check_supported(cfg, layout)
    slurm_conf = None
    if cfg.cluster.backend == "slurm" and not cfg.launcher.dry_run:
        slurm_conf = submit.resolve_slurm_conf(cfg)
        submit.check_slurm(cfg, slurm_conf)
    return layout, slurm_conf


def rank_map(layout: Layout) -> str:
    header = f"{'rank':>5} {'node':>5} {'local_rank':>10} {'pp':>3} {'dp':>3} {'dp_rep':>6} {'dp_shard':>8} {'tp':>3}"
    lines = [layout.describe(), header]
    for row in layout.rank_table():
        lines.append(f"{row['rank']:>5} {row['node']:>5} {row['local_rank']:>10} {row['pp']:>3} {row['dp']:>3} "
                     f"{row['dp_replicate']:>6} {row['dp_shard']:>8} {row['tp']:>3}")
    return "\n".join(lines)


def already_done(cfg: RunConfig, run_dir: Path, slurm_conf: Optional[str]) -> Optional[str]:
    """A reason not to start this run again, or None."""
    info = read_run_json(run_dir)
    if info.get("status") == "completed":
        return "already completed"
    job = str(info.get("job_id", ""))
    if cfg.cluster.backend == "slurm" and info.get("status") in ("submitted", "running") and job.isdigit():
        try:
            if query.squeue([job], query.slurm_env(slurm_conf)):
                return f"already in the queue as job {job}"
        except query.SlurmUnavailable:
            return None
    return None


def run_point(dcfg, run_dir: Path, multirun: bool, label: str, overrides: List[str]) -> int:
    def note(event: str, **fields) -> None:  # a sweep's registry (launcher.registry)
        if multirun:
            registry.record(run_dir.parent, run_dir.name, event, overrides=overrides, run_dir=str(run_dir),
                            **fields)

    try:
        cfg = run_config(dcfg)
        layout, slurm_conf = check(cfg)
    except ConfigError as exc:
        if multirun:
            print(f"skipped point {label}: {exc}", file=sys.stderr)
            STATE.skipped.append(label)
            if not dcfg.launcher.dry_run:
                note("skipped", reason=str(exc))
            return 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    reason = None if cfg.launcher.dry_run else already_done(cfg, run_dir, slurm_conf)
    if reason:
        note("unchanged", reason=reason, job_id=read_run_json(run_dir).get("job_id"))
        print(f"{label}: {reason}; nothing submitted (use launcher.run_dir=NEW_DIR for a new run)")
        print("\n".join(summary_lines(run_dir)))
        return 0
    (run_dir / CONFIG).write_text(to_yaml(cfg))
    write_provenance(run_dir)
    slurm = cfg.cluster.backend == "slurm"

    if cfg.launcher.dry_run:
        if slurm:
            script = submit.render_script(cfg, layout, run_dir)
            (run_dir / "sbatch.sh").write_text(script)
            print(script)
        else:
            print(f"local: {layout.world_size} x `{sys.executable} -m train {run_dir}` with RANK=0..."
                  f"{layout.world_size - 1}")
        print(rank_map(layout))
        print(f"dry run: nothing submitted\nrun_dir: {run_dir}")
        return 0

    code = launch(cfg, layout, run_dir, slurm_conf, label, wait=cfg.launcher.wait and not multirun)
    info = read_run_json(run_dir)
    note("submitted", job_id=info.get("job_id"), nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node,
         strategy=cfg.strategy.name, model=cfg.model.name, cluster=cfg.cluster.name,
         slurm_conf=slurm_conf)
    return code


def launch(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str], label: str,
           wait: bool) -> int:
    """Start (or restart) the run in ``run_dir``: locally, waiting, or on Slurm."""
    slurm = cfg.cluster.backend == "slurm"
    common = dict(strategy=cfg.strategy.name, nodes=cfg.cluster.nodes, world_size=layout.world_size,
                  cluster=cfg.cluster.name, model=cfg.model.name, run_dir=str(run_dir))
    if not slurm:
        update_run_json(run_dir, status="starting", job_id="local", requeues_since_submit=0, **common)
        print(f"local run: {layout.world_size} ranks on this machine\nrun_dir: {run_dir}", flush=True)
        code = local.run_local(cfg, layout, run_dir)
        if code and read_run_json(run_dir).get("status") not in ("failed", "interrupted"):
            update_run_json(run_dir, status="failed", error=f"a rank exited with status {code}")
        print("\n".join(summary_lines(run_dir)))
        return 0 if code == 0 and read_run_json(run_dir).get("status") == "completed" else 1

    job = submit.submit(cfg, layout, run_dir, slurm_conf)
    update_run_json(run_dir, status="submitted", job_id=str(job.job_id), requeues_since_submit=0, **common)
    STATE.submitted.append((str(job.job_id), run_dir, slurm_conf))
    print(f"submitted job {job.job_id} ({label}): {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} tasks")
    print(f"run_dir: {run_dir}", flush=True)
    if wait:
        return wait_and_report(str(job.job_id), run_dir, slurm_conf)
    return 0


def wait_and_report(job_id: str, run_dir: Path, slurm_conf: Optional[str]) -> int:
    state = submit.wait(job_id, run_dir, slurm_conf)
    print(f"\njob {job_id}: {state}")
    print("\n".join(summary_lines(run_dir)))
    return 0 if state == "COMPLETED" and read_run_json(run_dir).get("status") == "completed" else 1
