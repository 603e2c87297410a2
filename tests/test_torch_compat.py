"""The torch range (train/torch_compat.py): an older torch refused at a task's start in one
line, before any process group; the floor stated alike in pyproject.toml and
constraints-floor.txt; the private torch it fences checked against the running release,
with the one-pass checkpoint reader's fallback (DCP's own reader) giving the same state
and the same corruption errors."""
from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spec.rundir import START_REFUSALS, TORCH_VERSION
from train import torch_compat
from train.checkpoint import dcp_reader
from train.checkpoint.manifest import CorruptCheckpoint, file_crc32

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("found", ["2.10.1+cu128", "2.8.0a0+5228986c39.nv25.5", "1.13.1"])
def test_an_older_torch_is_refused_in_one_line_before_any_process_group(monkeypatch, found):
    from train.harness import dist as harness_dist

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was created before the torch check")

    monkeypatch.setattr(torch, "__version__", found)
    monkeypatch.setattr(dist, "init_process_group", no_group)
    with pytest.raises(torch_compat.UnsupportedTorch) as info:
        harness_dist.init_distributed(30)
    line = str(info.value)
    assert info.value.failure == TORCH_VERSION and TORCH_VERSION in START_REFUSALS  # run.json: failed, job ended
    assert "\n" not in line
    assert f"torch {found} is older than 2.11" in line  # the version found and the floor
    assert "install torch>=2.11" in line  # the fix
    assert not dist.is_initialized()


@pytest.mark.parametrize("text,release", [("2.11.0+cu130", (2, 11)), ("2.11.0", (2, 11)), ("2.13.0+cpu", (2, 13)),
                                          ("2.12.0a0+git1f2e3d4", (2, 12)), ("2.11.0a0+b1e0c4a.nv26.02", (2, 11)),
                                          ("3.0.0", (3, 0)), ("2.10.0", (2, 10))])
def test_versions_count_as_their_release(text, release):
    assert torch_compat.torch_version(text) == release
    if release >= torch_compat.FLOOR:
        torch_compat.require_supported_torch(text)  # NGC's pre-release tags of the floor pass
    else:
        with pytest.raises(torch_compat.UnsupportedTorch):
            torch_compat.require_supported_torch(text)


def test_a_version_that_does_not_parse_says_what_it_expected():
    with pytest.raises(ValueError, match=r"torch version 'nightly': expected MAJOR\.MINOR"):
        torch_compat.torch_version("nightly")


def test_the_running_torch_is_supported():
    torch_compat.require_supported_torch()


def test_the_floor_is_the_same_in_pyproject_constraints_and_code():
    floor = "{}.{}".format(*torch_compat.FLOOR)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.findall(r'"torch([<>=~!][^"]*)"', pyproject) == [f">={floor}"]  # torch itself, not torchao
    pins = [line for line in (REPO / "constraints-floor.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins == [f"torch=={floor}.0"]


# ---- private torch, checked against the running release ---------------------------------

def test_dcp_reader_internals_are_as_known_on_this_torch():
    torch_compat.dcp_reader_internals.cache_clear()
    assert torch_compat.dcp_reader_internals() == ""


def test_a_changed_storage_info_is_noticed(monkeypatch):
    from torch.distributed.checkpoint import filesystem

    @dataclasses.dataclass
    class Renamed:  # what a later release might hold instead
        relative_path: str
        offset: int
        size: int

    monkeypatch.setattr(filesystem, "_StorageInfo", Renamed)
    torch_compat.dcp_reader_internals.cache_clear()
    try:
        assert torch_compat.dcp_reader_internals() == "filesystem._StorageInfo has no length, transform_descriptors"
    finally:
        torch_compat.dcp_reader_internals.cache_clear()


@pytest.fixture()
def fallback_reader(monkeypatch):
    """verifying_reader() as on a torch whose FileSystemReader internals differ."""
    monkeypatch.setattr(torch_compat, "dcp_reader_internals", lambda: "FileSystemReader has no storage_data dict")
    dcp_reader.verifying_reader.cache_clear()
    yield dcp_reader.verifying_reader()
    dcp_reader.verifying_reader.cache_clear()


@pytest.fixture()
def saved(tmp_path):
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 32, generator=gen), "half": torch.randn(16, 8, generator=gen).bfloat16(),
             "step": torch.tensor(7), "lr": 0.5}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    return state, tmp_path, data


def _load(reader_cls, root, owned, state):
    import torch.distributed.checkpoint as dcp

    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    reader = reader_cls(root, owned)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out, reader


def test_the_fallback_reader_loads_the_same_state(fallback_reader, saved):
    state, root, data = saved
    assert fallback_reader.__name__ == "CheckingFirstReader"
    out, reader = _load(fallback_reader, root, {data.name: [data.stat().st_size, file_crc32(data)]}, state)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
        else:
            assert out[key] == value, key
    assert reader.direct == 0


def test_the_fallback_reader_reports_a_flipped_byte_as_corruption(fallback_reader, saved):
    from torch.distributed.checkpoint.api import CheckpointException

    state, root, data = saved
    owned = {data.name: [data.stat().st_size, file_crc32(data)]}
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        _load(fallback_reader, root, owned, state)
    (cause, _), = info.value.failures.values()
    assert isinstance(cause, CorruptCheckpoint) and str(cause) == f"checksum mismatch in dcp/{data.name}"


def test_torch_save_crc_is_off_in_the_block_and_kept_where_the_option_is_missing(monkeypatch):
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    with torch_compat.torch_save_without_crc():
        assert config.save.compute_crc32 is False
    assert config.save.compute_crc32 == before
    older = types.ModuleType("torch.utils.serialization")
    older.config = types.SimpleNamespace(save=types.SimpleNamespace())  # no compute_crc32, no patch()
    monkeypatch.setitem(sys.modules, "torch.utils.serialization", older)
    with torch_compat.torch_save_without_crc():  # a release without the option: torch.save sums as always
        pass


def test_missing_private_apis_are_named_with_the_fix(monkeypatch):
    class OldMesh:
        pass

    with pytest.raises(torch_compat.UnsupportedTorch, match=r"has no DeviceMesh\._flatten .*'dp'.*use torch 2\.11"):
        torch_compat.flatten_mesh(OldMesh(), "dp")
    monkeypatch.setitem(sys.modules, "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", None)
    with pytest.raises(torch_compat.UnsupportedTorch, match=r"checkpoint_wrapper .*activation_checkpointing"):
        torch_compat.checkpoint_wrapper(torch.nn.Linear(2, 2), preserve_rng_state=False)


def test_checkpoint_wrapper_keeps_the_parameter_names():
    """Why torch's private wrapper: names stay those of the plain module (DCP, FSDP)."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = torch_compat.checkpoint_wrapper(block, preserve_rng_state=False)
    assert list(wrapped.state_dict()) == list(block.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(wrapped(x), block(x))


@pytest.mark.parametrize("version,compiled,tp,checkpointed,refused", [
    ("2.13.0+cpu", True, True, True, True), ("2.14.0", True, True, True, True),
    ("2.11.0+cu130", True, True, True, False), ("2.13.0+cpu", False, True, True, False),
    ("2.13.0+cpu", True, False, True, False), ("2.13.0+cpu", True, True, False, False),
])
def test_compiled_tp_checkpointing_is_refused_where_torch_fails_it(version, compiled, tp, checkpointed, refused):
    """strategy.compile with tensor parallel and activation checkpointing: refused in one line
    from torch 2.13 (its AOTAutograd fails in the first backward), run on 2.11."""
    if not refused:
        torch_compat.refuse_compiled_tp_checkpointing(compiled, tp, checkpointed, version, host="n1")
        return
    with pytest.raises(torch_compat.UnsupportedTorch) as err:
        torch_compat.refuse_compiled_tp_checkpointing(compiled, tp, checkpointed, version, host="n1")
    assert str(err.value).startswith(f"n1: torch {version}: strategy.compile=true with tensor parallel and activation "
                                     "checkpointing fails") and "set strategy.activation_checkpointing=none" in \
        str(err.value) and "\n" not in str(err.value)
