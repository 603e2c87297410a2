"""The checkpoint backend (train.checkpoint.backend): chosen by the run's engine (its shape),
and the format every engine names is the one its run's backend writes; no engine has a
method it must refuse; what each backend answers; and the fault seam inside a save. One rank in this
process (a 1-rank gloo group); the multi-rank saves and resumes of every strategy:
tests/test_checkpoint.py, tests/test_resume_strategies.py, tests/test_reshard.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spec.config import FaultConfig
from train.checkpoint import Checkpointer, committed_steps
from train.checkpoint.backend import DCPBackend, backend_for
from train.checkpoint.deepspeed_io import DeepSpeedBackend
from train.harness import faults as faults_module
from train.harness.faults import Faults

ZERO2_DP2 = {"engine": "deepspeed", "zero_stage": 2, "dp": 2, "world_size": 2}


@pytest.mark.parametrize("shape, kind", [({}, DCPBackend), ({"engine": "torch"}, DCPBackend),
                                         ({"engine": "deepspeed", "zero_stage": 3}, DeepSpeedBackend)])
def test_the_backend_is_chosen_by_the_runs_engine(tmp_path, shape, kind):
    assert isinstance(backend_for(shape, 0), kind)
    assert isinstance(Checkpointer(tmp_path, 0, shape=shape).backend, kind)


def _engines():
    """(engine of the run's shape, the engine class its builder returns) for every builder,
    pipeline parallel's included (spec.support.BUILDERS, the builders' return annotations)."""
    import importlib
    import typing

    from spec.support import BUILDERS

    paths = {**{key: path for key, path in BUILDERS.items()},
             ("torch", "pp"): "train.strategies.pp:PipelineBuilder"}
    for (engine, _), path in sorted(paths.items()):
        module, name = path.split(":")
        builder = getattr(importlib.import_module(module), name)
        yield engine, typing.get_type_hints(builder.finish)["return"]


def test_every_engine_names_its_runs_backend_and_has_only_its_capability():
    from train.strategies import base

    own = {"dcp": base.DCPEngine, "deepspeed": base.NativeEngine}
    capability = {kind: set(vars(proto)) - set(vars(base.Engine)) - set(vars(object))
                  for kind, proto in own.items()}
    assert capability["dcp"] >= {"state_dict", "load_state_dict"}
    assert capability["deepspeed"] >= {"save_native", "load_native"}
    seen = set()
    for engine, cls in _engines():
        seen.add(cls.__name__)
        kind = cls.checkpoint_format
        assert kind == backend_for({"engine": engine}, 0).format, (cls, engine)
        assert all(callable(getattr(cls, name, None)) for name in capability[kind] if not name.startswith("_"))
        others = {name for k, names in capability.items() if k != kind for name in names if not name.startswith("_")}
        assert not any(hasattr(cls, name) for name in others), f"{cls.__name__} has another backend's methods"
    assert seen == {"TorchEngine", "PipelineEngine", "DeepSpeedEngine"}
    assert DCPBackend.format == "dcp" and DeepSpeedBackend.format == "deepspeed"


def test_what_each_backend_answers():
    dcp, ds = DCPBackend(0), DeepSpeedBackend(0, dict(ZERO2_DP2, dp=4))
    assert dcp.saves_async and dcp.loads_in_place and not ds.saves_async and not ds.loads_in_place
    assert dcp.summed_on_load("dcp/__1_0.distcp")  # DCP's data files: summed as they load
    assert not dcp.summed_on_load("dcp/.metadata") and not dcp.summed_on_load("extra_rank0.pt")
    assert not ds.summed_on_load("deepspeed/state/mp_rank_00_model_states.pt")  # all verified first
    assert dcp.plan_load(ZERO2_DP2) is False
    assert ds.plan_load(ZERO2_DP2) is True and ds.universal  # ZeRO-2 at dp 2, resumed at dp 4
    assert ds.plan_load(dict(ZERO2_DP2, dp=4)) is False and not ds.universal


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def dcp_engine():
    from train.strategies.base import DCPState

    module = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    engine = DCPState()
    engine.module, engine.optimizer = module, optimizer
    return engine


class Killed(Exception):
    pass


def test_kill_in_save_goes_through_the_seam_and_commits_nothing(tmp_path, one_rank, monkeypatch):
    def kill(pid, sig):
        raise Killed

    monkeypatch.setattr(faults_module.os, "kill", kill)
    engine = dcp_engine()
    ckpt = Checkpointer(tmp_path, 0, faults=Faults(FaultConfig(kill_in_save_at_step=2)))
    ckpt.save(engine, 1, {"loader": {"samples": 8}})
    ckpt.wait()
    with pytest.raises(Killed):
        ckpt.save(engine, 2, {"loader": {"samples": 16}})
    assert [p.name for p in committed_steps(tmp_path)] == ["step_00000001"]
    assert (tmp_path / ".tmp-step_00000002" / "dcp").is_dir()  # written, not committed
    restored = Checkpointer(tmp_path, 0).load_latest(engine, print)
    assert restored["step"] == 1 and restored["loader"] == {"samples": 8}
    assert not (tmp_path / ".tmp-step_00000002").exists()  # removed when a run starts


def test_async_save_asks_the_seam_before_snapshot_and_write(tmp_path, one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(Faults, "checkpoint_thread", lambda self: calls.append(self.cfg.slow_async_save_s))
    ckpt = Checkpointer(tmp_path, 0, faults=Faults(FaultConfig(slow_async_save_s=0.5)))
    ckpt.prepare_async()
    ckpt.save(dcp_engine(), 3, {"loader": {}}, blocking=False)
    ckpt.close()
    assert calls == [0.5, 0.5]
    assert [p.name for p in committed_steps(tmp_path)] == ["step_00000003"]


class NativeEngine:
    """An engine of the protocol's native capability (train.strategies.base.NativeEngine),
    without DeepSpeed; the backend still comes from the run's shape."""

    checkpoint_format = "deepspeed"

    def __init__(self) -> None:
        self.loaded = None

    def save_native(self, path: Path) -> None:
        (path / "state").mkdir(parents=True)
        (path / "state" / "mp_rank_00_model_states.pt").write_bytes(b"weights")

    def load_native(self, path: Path) -> None:
        self.loaded = path


def test_deepspeed_backend_saves_blocking_in_its_own_files_and_loads_them(tmp_path, one_rank):
    shape = dict(ZERO2_DP2, dp=1, world_size=1)
    ckpt = Checkpointer(tmp_path, 0, shape=shape)
    engine = NativeEngine()
    ckpt.save(engine, 5, {"loader": {}}, blocking=False)  # never async: committed on return
    ckpt.wait()
    step = tmp_path / "step_00000005"
    assert (step / "deepspeed" / "state" / "mp_rank_00_model_states.pt").is_file() and not (step / "dcp").exists()
    manifest = json.loads((step / "COMMITTED").read_text())
    assert "deepspeed/state/mp_rank_00_model_states.pt" in manifest["files"] and manifest["shape"] == shape
    fresh = Checkpointer(tmp_path, 0, shape=shape)
    assert fresh.plan_load() is False
    assert fresh.load_latest(engine, print)["step"] == 5 and engine.loaded == step / "deepspeed"


def test_deepspeed_checkpoint_of_another_shape_than_planned_is_skipped(tmp_path, one_rank):
    saved = dict(ZERO2_DP2, dp=1, world_size=1)
    Checkpointer(tmp_path, 0, shape=saved).save(NativeEngine(), 5, {"loader": {}})
    later = Checkpointer(tmp_path, 0, shape=dict(saved, dp=2))
    later.backend.universal = False  # as if the engine had been built for a checkpoint of this shape
    said = []
    engine = NativeEngine()
    assert later.load_latest(engine, said.append) is None and engine.loaded is None
    assert "saved at another shape than the newest checkpoint" in said[0] and not later.engine_dirty
