"""``python -m launcher +cluster=C [+model=M] [+strategy=S] [overrides] [-m]``

Compose (Hydra) -> check -> run directory -> submit (or run locally / dry run).
Without groups the embedded default runs: cluster=local, model=tiny, strategy=ddp.
Bad input exits 2 with one line naming the field, the value and the fix.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launcher.launch import Session, run_point
from launcher.overrides import check_overrides
from launcher.provenance import register_resolvers, remove_made
from spec.config import ConfigError, register_configs


def _task_function(session: Session):
    """Hydra's task function for this invocation: one point (a single run, or a sweep under
    another Hydra launcher). Our sweep launcher reads ``.session`` instead of calling it."""

    def task(dcfg: DictConfig) -> None:
        hc = HydraConfig.get()
        session.multirun = session.multirun or hc.mode == RunMode.MULTIRUN  # also hydra.mode=MULTIRUN
        overrides = list(hc.overrides.task)
        label = " ".join(overrides) or "defaults"
        if session.multirun:
            label = f"#{hc.job.num} {label}"
        code = run_point(session, dcfg, Path(hc.runtime.output_dir).resolve(), label, overrides)
        if not session.multirun and code:
            sys.exit(code)
        session.done(code)

    task.session = session  # type: ignore[attr-defined]
    return task


def _plugin_importable() -> None:
    """Hydra loads launchers only from the ``hydra_plugins`` namespace package; ours is
    ``hydra_plugins/sto_sweep`` in this checkout, which an editable install of the
    project (launcher, train, slurm) does not map. Append the checkout as a last resort."""
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.sto_sweep") is None:
        sys.path.append(str(Path(__file__).resolve().parent.parent))


def main() -> None:
    _plugin_importable()
    register_configs()
    made: Dict[str, Optional[Path]] = {}  # run directory -> what Hydra makes of it (launcher.provenance)
    register_resolvers(made)
    args = sys.argv[1:]
    multirun = "-m" in args or "--multirun" in args
    if multirun:  # Hydra's parser takes no override after -m; users write -m anywhere
        flags = [a for a in args if a in ("-m", "--multirun")]
        sys.argv = [sys.argv[0], *[a for a in args if a not in flags], *flags]
    if not any(a in ("-h", "--help", "--hydra-help", "--info", "-c", "--cfg") for a in args):
        try:
            check_overrides(args, multirun)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    session = Session(multirun=multirun)
    try:
        hydra.main(version_base="1.3", config_path="../conf", config_name="config")(_task_function(session))()
    except SystemExit as exc:
        if exc.code == 2 and not multirun:  # refused: none of the directories Hydra made for it stays
            for run_dir, first in made.items():
                remove_made(Path(run_dir), first)
        raise
    if not multirun:
        return
    if not session.accepted and session.skipped:
        if session.fresh_sweep_dir is not None:  # made by this refused sweep: leave no trace
            import shutil

            shutil.rmtree(session.fresh_sweep_dir, ignore_errors=True)
        print(f"error: every point was skipped ({len(session.skipped)}); nothing submitted", file=sys.stderr)
        sys.exit(2)
    if session.wait and session.submitted:
        from launcher.track.report import wait_sweep

        session.exit_code = max(session.exit_code, wait_sweep(session.submitted[0][1].parent, poll_s=1.0))
    if session.skipped:
        print(f"{len(session.submitted)} submitted, {len(session.skipped)} skipped", file=sys.stderr)
    sys.exit(session.exit_code)


if __name__ == "__main__":
    main()
