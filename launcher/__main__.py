"""``python -m launcher +cluster=C [+model=M] [+strategy=S] [overrides] [-m]``

Compose (Hydra) -> check -> run directory -> submit (or run locally / dry run).
Without groups the embedded default runs: cluster=local, model=tiny, strategy=ddp.
Bad input exits 2 with one line naming the field, the value and the fix.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launcher import app
from launcher.overrides import check_overrides
from launcher.provenance import register_resolvers
from spec.config import ConfigError, register_configs


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_entry(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    label = f"#{hc.job.num} " + (" ".join(hc.overrides.task) or "defaults") if multirun else \
        (" ".join(hc.overrides.task) or "defaults")
    code = app.run_point(dcfg, Path(hc.runtime.output_dir).resolve(), multirun, label, list(hc.overrides.task))
    if not multirun and code:
        sys.exit(code)
    app.STATE.exit_code = max(app.STATE.exit_code, 0 if code == 2 else code)


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
    register_resolvers()
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
    _hydra_entry()
    if not multirun:
        return
    state = app.STATE
    if not state.accepted and state.skipped:
        print(f"error: every point was skipped ({len(state.skipped)}); nothing submitted", file=sys.stderr)
        sys.exit(2)
    wait = any(a.startswith("launcher.wait=") and a.split("=", 1)[1].lower() in ("true", "1", "yes")
               for a in args)
    if wait and state.submitted:
        from launcher.track.progress import wait_sweep

        state.exit_code = max(state.exit_code, wait_sweep(state.submitted[0][1].parent, poll_s=1.0))
    if state.skipped:
        print(f"{len(state.submitted)} submitted, {len(state.skipped)} skipped", file=sys.stderr)
    sys.exit(state.exit_code)


if __name__ == "__main__":
    main()
