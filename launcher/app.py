"""One point of a launch: config -> checks -> run directory -> dry run | local | Slurm.

Without ``-m`` Hydra calls :func:`run_point` once. A sweep goes through our Hydra
launcher (``launcher.sweep``), which uses the same steps (:func:`checked`,
:func:`prepare`, :func:`dry_run`, :func:`launch` / :func:`submitted`) for all its points
at once. Each point returns at once after submission; ``launcher.wait=true`` waits (for
a sweep: for all points, after the last submission, see ``launcher.__main__``).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from launcher import local, submit
from launcher.track import registry
from launcher.plan.cli import check_fits
from launcher.provenance import write_provenance
from launcher.track.summary import summary_lines
from slurm import query
from spec.config import ConfigError, RunConfig, to_run_config
from spec.validate import validate
from spec.layout import Layout, build_layout
from spec.rundir import CONFIG, read_run_json, update_run_json
from spec.support import check_supported


@dataclass
class LaunchState:
    """What the points of this invocation did (read by __main__ after a sweep)."""

    submitted: List[Tuple[str, Path, Optional[str]]] = field(default_factory=list)  # job id, run dir, conf
    skipped: List[str] = field(default_factory=list)
    accepted: int = 0  # points that passed every check (submitted, run locally, dry run or unchanged)
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


# YAML text per (top-level section, its values): the points of a sweep differ in one or
# two sections, and the YAML emitter (pure Python) is the slow part of writing a config.
_YAML_SECTIONS: Dict[Tuple[str, str], str] = {}


def config_yaml(cfg: RunConfig) -> str:
    """``spec.config.to_yaml(cfg)``, the same text (tested), ~10x faster: the dataclasses
    go straight to OmegaConf's YAML dumper without a structured DictConfig (the schema
    holds plain values, lists and dicts only), one top-level section at a time (a block
    mapping is the concatenation of its keys' blocks)."""
    import dataclasses

    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    parts = []
    for name, value in dataclasses.asdict(cfg).items():
        key = (name, repr(value))  # repr tells 1, 1.0, "1" and True apart
        if key not in _YAML_SECTIONS:
            _YAML_SECTIONS[key] = yaml.dump({name: value}, Dumper=get_omega_conf_dumper(), default_flow_style=False,
                                            allow_unicode=True, sort_keys=False)
        parts.append(_YAML_SECTIONS[key])
    return "".join(parts)


def check(cfg: RunConfig) -> Tuple[Layout, Optional[str]]:
    """Every check that needs no submission; returns the layout and the slurm.conf to use."""
    validate(cfg)
    layout = build_layout(cfg)
    check_supported(cfg, layout)
    check_fits(cfg)  # the planner: refuse what is predicted not to fit (launcher.allow_oom=true overrides)
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


# A Slurm job id, or one element of a job array ("123_4").
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def already_done(cfg: RunConfig, run_dir: Path, slurm_conf: Optional[str],
                 queued: Optional[Dict[str, str]] = None) -> Optional[str]:
    """A reason not to start this run again, or None. ``queued``: squeue's answer for many
    runs at once (job id -> state), asked by the caller; None asks squeue here."""
    info = read_run_json(run_dir)
    if info.get("status") == "completed":
        return "already completed"
    job = str(info.get("job_id", ""))
    # Any unfinished status may still be queued: "requeued" / "interrupted" ones wait in
    # the queue for their next segment under the same job id. A run that ended ("failed",
    # "stopped") is restarted even while its job is still completing in the queue.
    if cfg.cluster.backend == "slurm" and info.get("status") not in ("failed", "stopped") and _JOB_ID.match(job):
        try:
            found = job in queued if queued is not None else bool(query.squeue([job], query.slurm_env(slurm_conf)))
        except query.SlurmUnavailable:
            return None
        if found:
            return f"already in the queue as job {job}"
    return None


@dataclass
class Point:
    """One point of a launch whose config passed every check."""

    cfg: RunConfig
    layout: Layout
    run_dir: Path
    slurm_conf: Optional[str]
    label: str
    overrides: List[str]
    multirun: bool

    def note(self, event: str, **fields) -> None:
        note(self.run_dir, self.multirun, self.overrides, event, **fields)

    def note_submitted(self) -> None:
        c = self.cfg
        self.note("submitted", job_id=read_run_json(self.run_dir).get("job_id"), nodes=c.cluster.nodes,
                  gpus_per_node=c.cluster.gpus_per_node, strategy=c.strategy.name, model=c.model.name,
                  cluster=c.cluster.name, slurm_conf=self.slurm_conf)


def note(run_dir: Path, multirun: bool, overrides: List[str], event: str, **fields) -> None:
    """An event of a sweep's point in the sweep's registry (launcher.track.registry); none for single runs."""
    if multirun:
        registry.record(run_dir.parent, run_dir.name, event, overrides=overrides, run_dir=str(run_dir), **fields)


def refuse(reason: str, run_dir: Path, multirun: bool, label: str, overrides: List[str], record: bool) -> int:
    """A config that failed a check: a sweep skips the point with its reason, a single run exits 2."""
    if not multirun:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    print(f"skipped point {label}: {reason}", file=sys.stderr)
    STATE.skipped.append(label)
    if record:
        note(run_dir, multirun, overrides, "skipped", reason=reason)
    return 2


def checked(config, run_dir: Path, multirun: bool, label: str, overrides: List[str]) -> Union[Point, int]:
    """The point, or the exit code of its refusal (printed, and recorded for a sweep).
    ``config``: Hydra's DictConfig, or the RunConfig already made from it."""
    try:
        cfg = config if isinstance(config, RunConfig) else run_config(config)
        layout, slurm_conf = check(cfg)
    except ConfigError as exc:
        return refuse(str(exc), run_dir, multirun, label, overrides, record=not config.launcher.dry_run)
    STATE.accepted += 1
    return Point(cfg, layout, run_dir, slurm_conf, label, overrides, multirun)


def prepare(p: Point, queued: Optional[Dict[str, str]] = None) -> Optional[int]:
    """Write the run directory; None when the run is to start, else the exit code (it needs nothing)."""
    p.run_dir.mkdir(parents=True, exist_ok=True)
    reason = None if p.cfg.launcher.dry_run else already_done(p.cfg, p.run_dir, p.slurm_conf, queued)
    if reason:
        p.note("unchanged", reason=reason, job_id=read_run_json(p.run_dir).get("job_id"))
        print(f"{p.label}: {reason}; nothing submitted (use launcher.run_dir=NEW_DIR for a new run)")
        print("\n".join(summary_lines(p.run_dir)))
        return 0
    (p.run_dir / CONFIG).write_text(config_yaml(p.cfg))
    write_provenance(p.run_dir)
    return None


def dry_run(p: Point) -> int:
    if p.cfg.cluster.backend == "slurm":
        script = submit.render_script(p.cfg, p.layout, p.run_dir)
        (p.run_dir / "sbatch.sh").write_text(script)
        print(script)
    else:
        print(f"local: {p.layout.world_size} x `{sys.executable} -m train {p.run_dir}` with RANK=0..."
              f"{p.layout.world_size - 1}")
    print(rank_map(p.layout))
    print(f"dry run: nothing submitted\nrun_dir: {p.run_dir}")
    return 0


def run_point(dcfg, run_dir: Path, multirun: bool, label: str, overrides: List[str]) -> int:
    """One point, start to end (a single run, or a sweep under another Hydra launcher)."""
    p = checked(dcfg, run_dir, multirun, label, overrides)
    if isinstance(p, int):
        return p
    code = prepare(p)
    if code is not None:
        return code
    if p.cfg.launcher.dry_run:
        return dry_run(p)
    code = launch(p.cfg, p.layout, run_dir, p.slurm_conf, label, wait=p.cfg.launcher.wait and not multirun)
    p.note_submitted()
    return code


def _common(cfg: RunConfig, layout: Layout, run_dir: Path) -> Dict[str, object]:
    return dict(strategy=cfg.strategy.name, nodes=cfg.cluster.nodes, world_size=layout.world_size,
                cluster=cfg.cluster.name, model=cfg.model.name, run_dir=str(run_dir))


def launch(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str], label: str,
           wait: bool) -> int:
    """Start (or restart) the run in ``run_dir``: locally, waiting, or on Slurm."""
    if cfg.cluster.backend != "slurm":
        update_run_json(run_dir, status="starting", job_id="local", requeues_since_submit=0,
                        **_common(cfg, layout, run_dir))
        print(f"local run: {layout.world_size} ranks on this machine\nrun_dir: {run_dir}", flush=True)
        code = local.run_local(cfg, layout, run_dir)
        if code and read_run_json(run_dir).get("status") not in ("failed", "interrupted"):
            update_run_json(run_dir, status="failed", error=f"a rank exited with status {code}")
        print("\n".join(summary_lines(run_dir)))
        return 0 if code == 0 and read_run_json(run_dir).get("status") == "completed" else 1

    job_id = str(submit.submit(cfg, layout, run_dir, slurm_conf).job_id)
    submitted(cfg, layout, run_dir, slurm_conf, label, job_id)
    if wait:
        return wait_and_report(job_id, run_dir, slurm_conf)
    return 0


def submitted(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str], label: str,
              job_id: str) -> None:
    """Record a submitted job (run.json, this launch's state) and print its two lines."""
    update_run_json(run_dir, status="submitted", job_id=job_id, requeues_since_submit=0,
                    **_common(cfg, layout, run_dir))
    STATE.submitted.append((job_id, run_dir, slurm_conf))
    print(f"submitted job {job_id} ({label}): {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} tasks")
    print(f"run_dir: {run_dir}", flush=True)


def wait_and_report(job_id: str, run_dir: Path, slurm_conf: Optional[str]) -> int:
    state = submit.wait(job_id, run_dir, slurm_conf)
    print(f"\njob {job_id}: {state}")
    print("\n".join(summary_lines(run_dir)))
    return 0 if state == "COMPLETED" and read_run_json(run_dir).get("status") == "completed" else 1
