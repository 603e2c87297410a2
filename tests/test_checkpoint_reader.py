"""The one-pass DCP reader (train/checkpoint/dcp_reader.py ``verifying_reader``), in one process:
the same tensors as DCP's own reader, read straight into their destination where it can,
and a flipped byte in a file it owns, or a short file, is reported as corruption."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from train.checkpoint.dcp_reader import TensorRecords, verifying_reader as _verifying_reader
from train.checkpoint.manifest import CorruptCheckpoint, file_crc32 as _crc32


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


def test_truncated_owned_file_is_corruption(saved):
    state, root, data = saved
    owned = _owned(data)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointException) as info:
        dcp.load(_empty_like(state), storage_reader=_verifying_reader()(root, owned), no_dist=True)
    assert _corrupt(info.value).startswith((f"truncated file dcp/{data.name}", f"checksum mismatch in dcp/{data.name}"))


@pytest.mark.parametrize("crc", [True, False])
def test_tensor_records_find_the_bytes_torch_load_reads(tmp_path, crc):
    """The layout torch.load gives and the offset of the tensor's bytes in its record, at
    any offset of a file (as in DCP's files), with or without torch.save's own CRCs (the
    writer leaves them out); other objects: None."""
    import io

    from torch.utils.serialization import config

    gen = torch.Generator().manual_seed(1)
    cases = [torch.randn(33, 7, generator=gen), torch.randn(5, generator=gen).bfloat16(), torch.tensor(3),
             torch.arange(12).reshape(3, 4).t(), torch.zeros(0), torch.randn(4, 4, generator=gen)[1:],
             torch.randn(33, 7, generator=gen), torch.arange(12).reshape(4, 3)]  # a record like the first: no parse
    others = (0.5, [1, 2], {"a": torch.ones(2)})
    path, spans = tmp_path / "records", []
    with open(path, "wb") as f, config.patch({"save.compute_crc32": crc}):
        f.write(b"x" * 100)  # records start anywhere in a file
        for obj in cases + list(others):
            buf = io.BytesIO()
            torch.save(obj, buf)
            spans.append((f.tell(), len(buf.getvalue())))
            f.write(buf.getvalue())
    records, raw = TensorRecords(), path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        for tensor, (start, length) in zip(cases, spans):
            found = records.find(fd, start, length)
            if tensor.storage_offset():  # a view into a larger storage: not read in place
                assert found is None
                continue
            meta, at = found
            assert (meta.dtype, meta.shape, meta.stride()) == (tensor.dtype, tensor.shape, tensor.stride())
            nbytes = tensor.untyped_storage().nbytes()
            assert raw[start + at:start + at + nbytes] == bytes(tensor.untyped_storage())
        for start, length in spans[len(cases):]:
            assert records.find(fd, start, length) is None
        assert len(records._known[spans[0][1]]) == 1  # the second (33, 7) record was not parsed again
    finally:
        os.close(fd)
