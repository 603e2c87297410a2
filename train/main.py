"""The built-in trainer as a workload of the task harness, and ``python -m train RUN_DIR``.

:func:`trainer` is the workload (model, data, strategies, checkpoints, loop);
:func:`train.harness.run.run_task` is everything around it that any workload gets.
Nothing here imports torch at module level: the entry points (``python -m train``,
:class:`train.job.TrainJob`) install the preemption flag first, then import this.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from slurm.env import AGENT_ENV
from spec.rundir import CONFIG, ENTRYPOINT, Status
from train.harness.preempt import PreemptionFlag
from train.harness.run import Task, run_task


def trainer(task: Task) -> Status:
    """Train up to ``train.steps``, resuming from the newest committed checkpoint."""
    from spec import evals
    from spec.batch import global_batch
    from spec.rundir import run_shape
    from train.checkpoint import Checkpointer
    from train.checkpoint.policy import SavePolicy
    from train.float8 import require_device
    from train.loop import train

    cfg = task.cfg
    require_device(cfg, task.ctx.device)  # strategy.float8 on a device without float8 matmuls: one line, exit 1
    on_commit = None
    if cfg.eval.on_checkpoint and task.ctx.is_main:  # the evaluation queue (spec/evals.py)
        on_commit = evals.enqueuer(evals.every(cfg.eval.every_steps, cfg.checkpoint.every_steps),
                                   lambda: task.cfg.train.steps,  # the loop resolves train.epochs into task.cfg
                                   task.run_dir, global_batch(cfg, task.layout)[1])
    ckpt = Checkpointer(task.run_dir / "checkpoints", task.ctx.rank, keep=cfg.checkpoint.keep,
                        shape=run_shape(cfg, task.layout), faults=task.faults, watchdog=task.watchdog,
                        policy=SavePolicy.of(cfg, task.run_dir if task.ctx.is_main else None), on_commit=on_commit)
    return train(task, ckpt)


def is_user_run(run_dir: str | Path) -> bool:
    """The run executes a user's script or function (entrypoint.json: launcher/entrypoint.py)."""
    return (Path(run_dir) / ENTRYPOINT).is_file()


def warm_imports(run_dir: str) -> None:
    """What every rank of the built-in trainer imports anyway: run once by rank 0 before it
    forks the other local ranks (:mod:`train.harness.forked`), or by a node's agent before
    it forks the node's (:mod:`train.harness.agent`); torch alone for a user's code (which
    imports the rest itself after the fork)."""
    from spec.config import to_run_config
    from spec.rundir import CONFIG

    if is_user_run(run_dir):
        if os.environ.get(AGENT_ENV):  # a node's agent; a local rank 0 runs the code itself
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        return
    cfg = to_run_config(Path(run_dir) / CONFIG)
    from spec.peft import base_identity

    base_identity(cfg)  # a LoRA base's fingerprint, read once a node: the forked ranks inherit it
    import torch  # noqa: F401

    from train.torch_compat import import_dynamo

    import_dynamo()  # torch._dynamo (the optimizer's constructor imports it)
    import torch.distributed.checkpoint  # noqa: F401  (saves and resumes)

    import train.loop  # noqa: F401
    from spec.layout import build_layout
    from train.strategies import get_builder

    layout = build_layout(cfg)
    if layout.pp > 1:
        import train.strategies.pp  # noqa: F401
    else:
        get_builder(cfg)
    if layout.tp_enabled:
        import train.strategies.tp  # noqa: F401
    freeze_imports()


def freeze_imports() -> None:
    """Move every object alive now (the imports: torch, DeepSpeed, ~400k objects) to the
    collector's permanent generation. A full collection (the trainer's before its steps and
    at the process group's teardown, DeepSpeed's own) then scans only the run's objects:
    0.4 s of CPU less each, and a forked rank no longer copies every page the imports
    touched when it collects (the collector writes into each object it scans)."""
    import gc

    gc.freeze()


def run(run_dir: str | Path, flag: PreemptionFlag | None = None) -> int:
    """One task of a job (the built-in trainer or a user's entry point); records the
    outcome in run.json. Returns 0, or a user's script's exit status."""
    if flag is None:
        flag = PreemptionFlag().install()  # before torch: see train.job
    if is_user_run(run_dir):
        from train.harness.user import run_user

        return run_user(run_dir, flag)
    # The trainer's imports (torch, its distributed packages: seconds) before the harness
    # joins the job and its watchdog's start-up clock runs.
    import train.loop  # noqa: F401
    freeze_imports()
    return run_task(run_dir, trainer, flag)


def main(argv: list[str] | None = None, flag: PreemptionFlag | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m train RUN_DIR   (RUN_DIR holds config.yaml, written by the launcher)\n"
              "       torchrun --nproc-per-node N -m train RUN_DIR", file=sys.stderr)
        return 2
    if not (Path(argv[0]) / CONFIG).is_file():
        print(f"error: {argv[0]}/{CONFIG} not found; create the run with `python -m launcher ... "
              f"launcher.dry_run=true` or pass a run directory", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run(argv[0], flag)
