"""One point of a launch: checked config -> run directory -> dry run | local | Slurm.

Without ``-m`` Hydra calls the CLI's task function once (:func:`run_point`). A sweep goes
through our Hydra launcher (:mod:`launcher.sweep`), which uses the same steps
(:func:`checked`, :func:`prepare`, :func:`dry_run`, :func:`start` / :func:`submitted`)
for all its points at once. Each point returns at once after submission;
``launcher.wait=true`` waits (for a sweep: for all points, after the last submission).

What the points of one invocation did is a :class:`Session` value that the CLI makes and
passes down; nothing here keeps state between calls.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from launcher import allocation, chain, entrypoint, local, resources, snapshot, submit
from launcher.checks import already_done, check
from launcher.compose import run_config
from launcher.plan.checkpoints import SavePlan, describe as describe_saves, predicted_step_s
from launcher.plan.gate import memory_line
from launcher.provenance import CodeState, code_state, write_provenance
from launcher.track import registry
from launcher.track.summary import summary_lines
from slurm.states import after_local_exit, succeeded
from spec.batch import batch_line
from spec.config import ConfigError, RunConfig
from spec.hf import apply_hf_model
from spec.layout import Layout
from spec.rundir import CONFIG, SBATCH, Status, read_run_json, status_of, update_run_json
from spec.schedule import schedule, schedule_line


@dataclass
class Session:
    """What the points of this invocation did (the CLI reads it after a sweep)."""

    multirun: bool = False
    submitted: List[Tuple[str, Path, Optional[str]]] = field(default_factory=list)  # job id, run dir, conf
    skipped: List[str] = field(default_factory=list)
    accepted: int = 0  # points that passed every check (submitted, run locally, dry run or unchanged)
    exit_code: int = 0
    wait: bool = False  # a submitted point asked for launcher.wait=true
    # YAML text per (top-level section, its values): the points of a sweep differ in one or
    # two sections, and the YAML emitter (pure Python) is the slow part of writing a config.
    yaml_sections: Dict[Tuple[str, str], str] = field(default_factory=dict)
    code: Optional[CodeState] = None  # git commit, diff, versions: asked once per launch
    entry_code: Dict[str, dict] = field(default_factory=dict)  # a user's entry file -> its sha256 and git state
    probe: submit.SlurmProbe = field(default_factory=submit.SlurmProbe)  # Slurm's answers, once per launch
    fresh_sweep_dir: Optional[Path] = None  # the outermost directory this sweep made (runs/, multirun/, ...)
    code_trees: Dict[object, snapshot.Tree] = field(default_factory=dict)  # source trees listed (launcher.snapshot)
    frozen: Dict[snapshot.Plan, snapshot.Frozen] = field(default_factory=dict)  # their copies made by this launch

    def code_state(self) -> CodeState:
        if self.code is None:
            self.code = code_state()
        return self.code

    def done(self, code: int) -> None:
        """A point's exit code: a skipped point (2) does not fail a sweep."""
        self.exit_code = max(self.exit_code, 0 if code == 2 else code)


def config_yaml(cfg: RunConfig, cache: Dict[Tuple[str, str], str]) -> str:
    """``spec.config.to_yaml(cfg)``, the same text (tested), ~10x faster: the dataclasses
    go straight to OmegaConf's YAML dumper without a structured DictConfig (the schema
    holds plain values, lists and dicts only), one top-level section at a time (a block
    mapping is the concatenation of its keys' blocks)."""
    import yaml

    from launcher.compat import omegaconf_yaml_dumper

    dumper = omegaconf_yaml_dumper()
    parts = []
    for name, value in dataclasses.asdict(cfg).items():
        key = (name, repr(value))  # repr tells 1, 1.0, "1" and True apart
        if key not in cache:
            cache[key] = yaml.dump({name: value}, Dumper=dumper, default_flow_style=False,
                                   allow_unicode=True, sort_keys=False)
        parts.append(cache[key])
    return "".join(parts)


def rank_map(layout: Layout) -> str:
    cp = layout.cp > 1  # context parallel's column only where it splits sequences
    header = (f"{'rank':>5} {'node':>5} {'local_rank':>10} {'pp':>3} {'dp':>3} {'dp_rep':>6} {'dp_shard':>8}"
              + (f" {'cp':>3}" if cp else "") + f" {'tp':>3}")
    lines = [layout.describe(), header]
    for row in layout.rank_table():
        lines.append(f"{row['rank']:>5} {row['node']:>5} {row['local_rank']:>10} {row['pp']:>3} {row['dp']:>3} "
                     f"{row['dp_replicate']:>6} {row['dp_shard']:>8}" + (f" {row['cp']:>3}" if cp else "")
                     + f" {row['tp']:>3}")
    return "\n".join(lines)


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
    entry: Optional[dict] = None  # a user's entry point (launcher.entrypoint); None: the built-in trainer
    code: Optional[snapshot.Plan] = None  # the code to freeze at submission (launcher.snapshot); None: none
    frozen: Optional[snapshot.Frozen] = None  # the copies the tasks import, once made (or kept by a resume)
    saves: Optional[SavePlan] = None  # the checkpoint plan (launcher/plan/checkpoints.py); None: a user's entry point

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


def remove_empty(run_dir: Path) -> None:
    """Remove ``run_dir`` and its parents below the current directory while they are empty."""
    cwd = Path.cwd().resolve()
    for d in (run_dir.resolve(), *run_dir.resolve().parents):
        if d == cwd or cwd not in d.parents:
            return
        try:
            d.rmdir()
        except OSError:  # not empty (another run's), or gone
            return


def refuse(session: Session, reason: str, run_dir: Path, label: str, overrides: List[str], record: bool) -> int:
    """A config that failed a check: a sweep skips the point with its reason, a single run exits 2."""
    if not session.multirun:
        print(f"error: {reason}", file=sys.stderr)
        remove_empty(run_dir)  # the empty directory Hydra made for the run: a refusal leaves nothing
        return 2
    print(f"skipped point {label}: {reason}", file=sys.stderr)
    session.skipped.append(label)
    if record:
        note(run_dir, True, overrides, "skipped", reason=reason)
    return 2


def checked(session: Session, config, run_dir: Path, label: str, overrides: List[str]) -> Union[Point, int]:
    """The point, or the exit code of its refusal (printed, and recorded for a sweep).
    ``config``: Hydra's DictConfig, or the RunConfig already made from it."""
    try:
        cfg = config if isinstance(config, RunConfig) else run_config(config)
        apply_hf_model(cfg, overrides)
        entry = entrypoint.resolve(cfg, cache=session.entry_code)
        layout, slurm_conf, saves = check(cfg, session.probe)
        code = snapshot.plan(cfg, run_dir, entry, session.code_trees)
    except ConfigError as exc:
        return refuse(session, str(exc), run_dir, label, overrides, record=not config.launcher.dry_run)
    session.accepted += 1
    return Point(cfg, layout, run_dir, slurm_conf, label, overrides, session.multirun, entry, code, saves=saves)


def prepare(session: Session, p: Point, queued: Optional[Dict[str, str]] = None) -> Optional[int]:
    """Write the run directory; None when the run is to start, else the exit code (it needs nothing)."""
    p.run_dir.mkdir(parents=True, exist_ok=True)
    reason = None if p.cfg.launcher.dry_run else already_done(p.cfg, p.run_dir, p.slurm_conf, queued)
    if reason:
        p.note("unchanged", reason=reason, job_id=read_run_json(p.run_dir).get("job_id"))
        print(f"{p.label}: {reason}; nothing submitted (use launcher.run_dir=NEW_DIR for a new run)")
        print("\n".join(summary_lines(p.run_dir)))
        return 0
    (p.run_dir / CONFIG).write_text(config_yaml(p.cfg, session.yaml_sections))
    if p.cfg.launcher.dry_run:
        entrypoint.write(p.run_dir, p.entry, p.cfg)
    else:
        freeze_code(p, session.frozen)
    write_provenance(p.run_dir, session.code_state())
    return None


def freeze_code(p: Point, memo: Optional[Dict[snapshot.Plan, snapshot.Frozen]] = None) -> None:
    """Copy the point's code for its tasks (launcher.snapshot; once per launch: ``memo``)
    and write entrypoint.json naming the entry point's copy."""
    p.frozen = snapshot.freeze(p.code, memo) if p.code is not None else None
    entrypoint.write(p.run_dir, snapshot.entry_for_tasks(p.entry, p.frozen), p.cfg)


def dry_run(p: Point) -> int:
    if p.cfg.cluster.backend == "slurm":
        code = p.frozen or (p.code.would_be() if p.code is not None else None)
        script = submit.render_script(p.cfg, p.layout, p.run_dir, code=code)
        (p.run_dir / SBATCH).write_text(script)
        print(script)
        print(resources.resources_line(p.cfg))
        print(snapshot.describe(code, p.cfg, "keeps" if p.frozen else "would freeze"))
        for i, step in enumerate(p.cfg.launcher.then):  # launcher/chain.py: each waits on the one before
            print(f"then: {step}: a job of its own ({p.cfg.launcher.then_dependency} on "
                  f"{'the training job' if i == 0 else 'the one before'})")
    else:
        print(f"local: {p.layout.world_size} x `{sys.executable} -m train {p.run_dir}` with RANK=0..."
              f"{p.layout.world_size - 1}")
    print(rank_map(p.layout))
    if p.entry is not None:
        print(task_view(p))
    else:
        print(batch_lines(p.cfg, p.layout, p.saves))
        plan = memory_line(p.cfg, p.layout)
        if plan:
            print(plan)
    print(f"dry run: nothing submitted\nrun_dir: {p.run_dir}")
    return 0


def task_view(p: Point) -> str:
    """What every task of a user's entry point runs and receives (the dry run shows it)."""
    from spec.user_env import task_environment

    what = (f"{p.entry['path']} as __main__, argv {[p.entry['path'], *p.cfg.entrypoint_args]}"
            if p.entry["kind"] == "script" else f"{p.entry['module']}:{p.entry['function']}(cfg)")
    lines = [f"every task runs {what}",
             "environment of rank 0 (others differ in RANK, LOCAL_RANK, GROUP_RANK, STO_DEVICE):"]
    env = task_environment(p.cfg, p.layout, p.run_dir, rank=0)
    lines += [f"  {key}={value}" for key, value in sorted(env.items())]
    return "\n".join(lines)


def run_point(session: Session, dcfg, run_dir: Path, label: str, overrides: List[str]) -> int:
    """One point, start to end (a single run, or a sweep under another Hydra launcher)."""
    p = checked(session, dcfg, run_dir, label, overrides)
    if isinstance(p, int):
        return p
    code = prepare(session, p)
    if code is not None:
        return code
    if p.cfg.launcher.dry_run:
        return dry_run(p)
    code = start(session, p, wait=p.cfg.launcher.wait and not session.multirun)
    p.note_submitted()
    return code


def batch_lines(cfg: RunConfig, layout: Layout, saves: Optional[SavePlan] = None) -> str:
    """The built-in trainer's global batch and schedule (spec/batch.py, spec/schedule.py)
    and, given its plan, when it saves (launcher/plan/checkpoints.py)."""
    lines = [batch_line(cfg, layout), schedule_line(cfg, schedule(cfg, layout))]
    if saves is not None:
        lines += describe_saves(cfg, saves, predicted_step_s(cfg, layout))
    return "\n".join(lines)


def _common(cfg: RunConfig, layout: Layout, run_dir: Path) -> Dict[str, object]:
    steps = cfg.train.steps if cfg.entrypoint else schedule(cfg, layout).total_steps  # train.epochs: derived
    return dict(strategy=cfg.strategy.name, nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node,
                world_size=layout.world_size, steps=steps, epochs=cfg.train.epochs or None, cluster=cfg.cluster.name,
                model=cfg.model.name, run_dir=str(run_dir))


def start(session: Optional[Session], p: Point, wait: bool, convert: Optional[int] = None) -> int:
    """Start (or restart) the run of ``p``: locally, waiting, or on Slurm. ``convert``: the
    ZeRO stage to convert the newest checkpoint for first (:mod:`train.checkpoint.convert`)."""
    cfg, layout, run_dir = p.cfg, p.layout, p.run_dir
    if convert is not None and cfg.cluster.backend != "slurm":
        converted = subprocess.run([sys.executable, "-m", "train.checkpoint.convert", str(run_dir), str(convert)])
        if converted.returncode:  # the job converts again and reports why, or falls back
            print(f"conversion before the job failed (exit {converted.returncode}); the job tries again")
    if cfg.cluster.backend != "slurm":
        update_run_json(run_dir, status=Status.STARTING, job_id="local", requeues_since_submit=0,
                        code_snapshot=snapshot.record(None, cfg), **_common(cfg, layout, run_dir))
        print(f"local run: {layout.world_size} ranks on this machine\n{batch_lines(cfg, layout, p.saves)}\nrun_dir: {run_dir}",
              flush=True)
        code = local.run_local(cfg, layout, run_dir)
        end = after_local_exit(status_of(read_run_json(run_dir)), code)
        if end is not None:
            update_run_json(run_dir, status=end, error=f"a rank exited with status {code}")
        print("\n".join(summary_lines(run_dir)))
        return 0 if succeeded(status_of(read_run_json(run_dir)), exit_code=code) else 1

    after = None
    if convert is not None:
        after = submit.submit_conversion(cfg, layout, run_dir, convert, p.slurm_conf, p.frozen)
        update_run_json(run_dir, conversion_job=after)
        print(f"submitted job {after}: DeepSpeed's universal conversion of the newest checkpoint for ZeRO stage "
              f"{convert} (1 node, CPUs only); the training job starts after it")
    if allocation.in_use(cfg) and after is None:
        return in_allocation(p, wait)
    job_id = str(submit.submit(cfg, layout, run_dir, p.slurm_conf, after=after, code=p.frozen).job_id)
    submitted(session, p, job_id)
    if read_run_json(run_dir).get("allocation"):  # resumed as a job of its own after an allocation's segment
        update_run_json(run_dir, allocation=None)
    if cfg.launcher.then:
        steps = chain.submit(cfg, run_dir, job_id, p.slurm_conf, submit.job_pythons(cfg, p.frozen)[1], p.frozen)
        update_run_json(run_dir, chain=steps)
        for step in steps:
            print(f"then: {step['step']}: job {step['job_id']} ({cfg.launcher.then_dependency}:{step['after']})")
    if wait:
        return wait_and_report(job_id, run_dir, p.slurm_conf, cfg.launcher.wait_poll_s, cfg.launcher.wait_max_poll_s)
    return 0


def in_allocation(p: Point, wait: bool) -> int:
    """Start the run as steps of the allocation this launch runs in (cluster.allocation=auto)."""
    job, proc = allocation.start(p.cfg, p.layout, p.run_dir, p.slurm_conf, p.frozen)
    submitted(None, p, job, f"started in allocation {job} (cluster.allocation=auto: no new job)")
    update_run_json(p.run_dir, allocation=job)
    if not wait:
        return 0
    code = proc.wait()
    print(f"\nallocation {job}: the run's batch script ended with {code}")
    print("\n".join(summary_lines(p.run_dir)))
    return 0 if succeeded(status_of(read_run_json(p.run_dir)), exit_code=code) else 1


def submitted(session: Optional[Session], p: Point, job_id: str, how: str = "") -> None:
    """Record a submitted job (run.json, this launch's session) and print its two lines."""
    update_run_json(p.run_dir, status=Status.SUBMITTED, job_id=job_id, requeues_since_submit=0,
                    slurm_conf=p.slurm_conf, code_snapshot=snapshot.record(p.frozen, p.cfg),
                    **_common(p.cfg, p.layout, p.run_dir))
    if session is not None:
        session.submitted.append((job_id, p.run_dir, p.slurm_conf))
        session.wait = session.wait or p.cfg.launcher.wait
    print(f"{how or f'submitted job {job_id}'} ({p.label}): {p.cfg.cluster.nodes} node(s) x "
          f"{p.cfg.cluster.gpus_per_node} tasks")
    print(snapshot.describe(p.frozen, p.cfg, "froze"))
    if p.entry is None:
        print(batch_lines(p.cfg, p.layout, p.saves))
    print(f"run_dir: {p.run_dir}", flush=True)


def wait_and_report(job_id: str, run_dir: Path, slurm_conf: Optional[str], poll_s: float = 1.0,
                    max_poll_s: float = 30.0) -> int:
    state = submit.wait(job_id, run_dir, slurm_conf, poll_s, max_poll_s)
    print(f"\njob {job_id}: {state}")
    print("\n".join(summary_lines(run_dir)))
    return 0 if succeeded(status_of(read_run_json(run_dir)), slurm_state=state) else 1
