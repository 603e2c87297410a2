"""The one-pass DCP reader (train/checkpoint/manager.py ``_verifying_reader``), in one process:
the same tensors as DCP's own reader, read straight into their destination where it can,
and a flipped byte in a file it owns is reported as corruption."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from train.checkpoint.manager import CorruptCheckpoint, _crc32, _verifying_reader, tensor_record


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=gen), "half": torch.randn(16, 8, generator=gen).bfloat16(),
            "step": torch.tensor(7), "ids": torch.arange(10), "t": torch.randn(8, 4, generator=gen),
            "lr": 0.5, "names": ["a", "b"]}


def _empty_like(state: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    out["t"] = torch.zeros(4, 8).t()  # a non-contiguous destination: DCP's way (load, then copy)
    return out


@pytest.fixture()
def saved(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    return state, tmp_path, data


def _owned(data):
    return {data.name: [data.stat().st_size, _crc32(data)]}


def test_same_state_as_dcp_and_tensors_read_in_place(saved):
    state, root, data = saved
    ours, theirs = _empty_like(state), _empty_like(state)
    reader = _verifying_reader()(root, _owned(data))
    dcp.load(ours, storage_reader=reader, no_dist=True)
    dcp.load(theirs, checkpoint_id=str(root), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
            assert torch.equal(ours[key], theirs[key]), key
        else:
            assert ours[key] == value == theirs[key], key
    assert reader.direct == 4  # w, half, step, ids; not the transposed destination


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_in_an_owned_file_is_corruption(saved, where):
    state, root, data = saved
    owned = _owned(data)  # the manifest: size and CRC as written
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 if where == "data" else 40] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load(_empty_like(state), storage_reader=_verifying_reader()(root, owned), no_dist=True)
    assert _corrupt(info.value) == f"checksum mismatch in dcp/{data.name}"


def test_unowned_file_is_read_without_checksum(saved):
    state, root, _ = saved
    out = _empty_like(state)
    dcp.load(out, storage_reader=_verifying_reader()(root, {}), no_dist=True)
    assert torch.equal(out["w"], state["w"])


def _corrupt(exc: CheckpointException) -> str:
    """The CorruptCheckpoint behind DCP's CheckpointException."""
    (cause, _), = exc.failures.values()
    assert isinstance(cause, CorruptCheckpoint), repr(cause)
    return str(cause)


def test_tensor_record_finds_the_bytes_torch_load_finds(tmp_path):
    """The front-to-back walk of a torch.save record gives the layout and the offset that
    torch.load(map_location="meta") reads from the central directory; other objects: None."""
    import io

    gen = torch.Generator().manual_seed(1)
    cases = [torch.randn(33, 7, generator=gen), torch.randn(5, generator=gen).bfloat16(), torch.tensor(3),
             torch.arange(12).reshape(3, 4).t(), torch.zeros(0), torch.randn(4, 4, generator=gen)[1:]]
    for tensor in cases:
        buf = io.BytesIO()
        torch.save(tensor, buf)
        blob = buf.getvalue()
        meta = torch.load(io.BytesIO(blob), map_location="meta", weights_only=True)
        dtype, shape, stride, offset, nbytes, start = tensor_record(blob)
        assert (dtype, shape, stride, offset) == (tensor.dtype, tuple(tensor.shape), tensor.stride(),
                                                  tensor.storage_offset())
        assert start == meta.untyped_storage()._checkpoint_offset
        assert nbytes == tensor.untyped_storage().nbytes()
        assert blob[start:start + nbytes] == bytes(tensor.untyped_storage())
    for other in (0.5, [1, 2], {"a": torch.ones(2)}):
        buf = io.BytesIO()
        torch.save(other, buf)
        assert tensor_record(buf.getvalue()) is None
