"""Helpers shared by tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from launcher.overrides import CONF_DIR
from launcher.rundir import register_resolvers
from train.config import RunConfig, register_configs, to_run_config

register_configs()
register_resolvers()


def compose_run(overrides: list[str]) -> RunConfig:
    """Compose conf/ like `python -m launcher OVERRIDES` does, as dataclasses."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=overrides))


def strategy_options() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))


def assert_committed(root) -> None:
    """Every checkpoint under ``root`` verifies, and its manifest names every file in it
    (the ranks' CRC side files are merged into it and gone)."""
    import json
    from pathlib import Path

    from train.checkpoint import MANIFEST, verify

    steps = sorted(Path(root).glob("step_*"))
    assert steps, f"no committed checkpoint under {root}"
    for ckpt in steps:
        assert verify(ckpt) is None, ckpt
        listed = set(json.loads((ckpt / MANIFEST).read_text())["files"])
        on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert listed == on_disk, (ckpt, listed ^ on_disk)
