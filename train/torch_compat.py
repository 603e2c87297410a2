"""The torch releases this project runs on, and its uses of torch (and DeepSpeed) that depend on
the release: the compute side's one fence for private third-party names.

**Range.** :data:`FLOOR` (2.11, what the lent GPU machines and recent NGC images carry) is
the lowest release tested: ``make test-torch-floor`` runs the multi-rank strategy,
checkpoint (both DCP readers) and Hugging Face tests on it (``.venv-floor``, pinned by
constraints-floor.txt); the rest of the suite runs on the CPU build pinned in
constraints-cpu.txt (2.13). pyproject.toml says ``torch>=2.11``, and
:func:`require_supported_torch` refuses an older torch at a task's start, in one line,
before any process group (train/harness/dist.py ``init_distributed``): an older torch would
otherwise fail later and far from the cause (a missing keyword, an import deep in DCP).

**Public APIs newer than some releases, present in the floor** (no fallback needed: the
refusal above keeps older releases out): ``torch.distributed.checkpoint.HuggingFaceStorageReader``
(train/hf_io.py), ``distribute_tensor(..., src_data_rank=None)`` (train/model.py, torch 2.7),
``torch.utils.serialization.config``'s ``save.compute_crc32`` (train/checkpoint/dcp_writer.py,
through :func:`torch_save_without_crc`, which keeps torch.save's CRC where a release lacks it).

**Private torch, fenced here**, each with why it is used, the releases it was read on
(2.11 and 2.13: the same code in both), and a check against the running torch:

- DCP's ``FileSystemReader`` internals (``storage_data``'s ``_StorageInfo`` entries: file,
  offset, length, transforms; ``transforms.transform_load_stream``), which the one-pass
  reader train/checkpoint/dcp_reader.py reads to checksum and load a file in one read.
  :func:`dcp_reader_internals` checks them; where they differ, dcp_reader falls back to
  DCP's own reader after a separate checksum pass (the disk read twice, same result).
- ``DeviceMesh._flatten`` (train/mesh.py): the one mesh over dp_replicate x dp_shard, as
  torchtitan builds it; 2.13 warns that slicing a flattened dim from the root mesh is
  going away, and no public way exists yet. :func:`flatten_mesh` checks it is there.
- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (train/parallelize.py):
  activation checkpointing that keeps parameter names (its state-dict hooks drop the
  wrapper's prefix, which DCP and FSDP rely on), as torchtitan uses it; no public
  equivalent. :func:`checkpoint_wrapper` imports it, or says what is missing.

- ``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (train/model.py): the
  type of a collective's pending result, which :func:`settled` turns into a plain tensor
  before the compiled blocks (a compiled block given one lost its gradient on 2.13).

- ``torch.utils.cpp_extension.TORCH_LIB_PATH``, a module constant that its JIT builds
  link against, unquoted: :func:`link_path_without_spaces` repoints it under a path with
  a space (DeepSpeed's CPU communication op, train/strategies/deepspeed.py).

**Private torch and DeepSpeed, one small function each** (at the end of this module; why, and the
releases read, in each docstring: 2.13, this project's CPU build, and 2.11 where it says):

- ``torch._foreach_copy_`` and ``DTensor(local, spec)`` with a DTensor's ``_spec``
  (train/checkpoint/async_save.py's snapshot): :func:`foreach_copy`, :func:`host_dtensor`.
- ``torch.cuda.memory``'s ``_set_allocator_settings`` (train/harness/dist.py),
  ``_record_memory_history`` and ``_dump_snapshot`` (train/profiling.py):
  :func:`set_allocator_settings`, :func:`record_memory_history`, :func:`dump_memory_snapshot`.
- ``torch._C._distributed_c10d._dump_nccl_trace`` (train/harness/watchdog.py): :func:`nccl_trace`.
- ``distributed_c10d._world.pg_map`` (train/harness/groups.py): :func:`live_process_groups`.
- ``torch._dynamo``, imported ahead of the fork (train/main.py): :func:`import_dynamo`.
- ``torch.testing._internal.distributed.fake_pg`` (tests and bench only):
  :func:`fake_process_group`.
- DeepSpeed's ``zero.Init._zero_init_param`` and ``_convert_to_deepspeed_param`` (DeepSpeed
  0.19.8): :func:`zero_init_without_broadcast`, for train/strategies/deepspeed.py's
  ``partitioned_build``, which still holds its own copy until it calls this.

These are the compute side's only uses of private names of torch, DeepSpeed, Hydra,
omegaconf, submitit or transformers: tests/test_structure.py refuses one anywhere else
(the login side's are in launcher/compat.py, submitit's in slurm/submitit_adapter.py;
that test's docstring says what it cannot see).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import socket
from typing import Optional, Tuple

import torch

from spec.device import DeviceError
from spec.rundir import TORCH_VERSION

FLOOR: Tuple[int, int] = (2, 11)
# The newest release the whole suite runs on (constraints-cpu.txt); the private uses
# above were read in FLOOR's and this release's sources.
NEWEST_TESTED: Tuple[int, int] = (2, 13)


def _text(version: Tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


class UnsupportedTorch(DeviceError):
    """A task whose torch is older than :data:`FLOOR`, or lacks a private piece fenced
    here: one line naming the host, the version found, the floor and the fix. A
    :class:`~spec.device.DeviceError`, so a task refused at start records run.json
    ``failed`` with ``failure: torch_version`` and ends the job, as for no CUDA."""

    def __init__(self, line: str) -> None:
        super().__init__(line, TORCH_VERSION)


def torch_version(text: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of a torch version string (``torch.__version__`` when None): a local
    build tag (``+cu130``) or a pre-release of NGC's images (``2.11.0a0+...nv26.02``) counts
    as its release. ValueError for a string that does not start with major.minor."""
    text = str(torch.__version__) if text is None else text
    found = re.match(r"\s*(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"torch version {text!r}: expected MAJOR.MINOR[...], e.g. 2.11.0+cu130")
    return int(found.group(1)), int(found.group(2))


def require_supported_torch(version: Optional[str] = None, host: Optional[str] = None) -> None:
    """Refuse (:class:`UnsupportedTorch`) a torch older than :data:`FLOOR`. ``version``:
    ``torch.__version__`` when None (read at the call, so a test can set it)."""
    text = str(torch.__version__) if version is None else version
    if torch_version(text) >= FLOOR:
        return
    raise UnsupportedTorch(
        f"{host or socket.gethostname()}: torch {text} is older than {_text(FLOOR)}, the lowest release this project "
        f"supports (tested {_text(FLOOR)} to {_text(NEWEST_TESTED)}): install torch>={_text(FLOOR)} in the job's "
        f"environment (pip install 'torch>={_text(FLOOR)}', or a container image that carries it)")


@contextlib.contextmanager
def torch_save_without_crc():
    """``torch.save`` without its own CRC32 of each zip record, for the time of the block,
    where the release has the option (``save.compute_crc32``); elsewhere torch.save sums
    as always (slower, the same files: torch.load reads both)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        config = None
    if config is None or not hasattr(getattr(config, "save", None), "compute_crc32"):
        yield
        return
    with config.patch({"save.compute_crc32": False}):
        yield


_STORAGE_INFO_FIELDS = {"relative_path", "offset", "length", "transform_descriptors"}


@functools.lru_cache(maxsize=None)
def dcp_reader_internals() -> str:
    """"" when DCP's ``FileSystemReader`` internals the one-pass reader needs are as in
    2.11-2.13 on the running torch; else what differs (the reader then takes DCP's own way)."""
    try:
        from torch.distributed.checkpoint import filesystem
    except ImportError as exc:
        return f"torch.distributed.checkpoint.filesystem: {exc}"
    info = getattr(filesystem, "_StorageInfo", None)
    if info is None or not dataclasses.is_dataclass(info):
        return "no dataclass filesystem._StorageInfo"
    missing = _STORAGE_INFO_FIELDS - {f.name for f in dataclasses.fields(info)}
    if missing:
        return f"filesystem._StorageInfo has no {', '.join(sorted(missing))}"
    reader = filesystem.FileSystemReader(".")  # no I/O before read_metadata
    if not isinstance(getattr(reader, "storage_data", None), dict):
        return "FileSystemReader has no storage_data dict"
    if not callable(getattr(getattr(reader, "transforms", None), "transform_load_stream", None)):
        return "FileSystemReader.transforms has no transform_load_stream"
    return ""


def _missing(what: str, use: str) -> UnsupportedTorch:
    return UnsupportedTorch(f"torch {torch.__version__} has no {what} (private torch, read on {_text(FLOOR)} to "
                            f"{_text(NEWEST_TESTED)}), which {use}: use torch {_text(FLOOR)} to {_text(NEWEST_TESTED)}, "
                            f"or adapt train/torch_compat.py")


def flatten_mesh(mesh, name: str):
    """``mesh._flatten(name)``: a 1-D mesh over all of ``mesh``'s dims (cached by torch per
    name: a second call returns the same mesh)."""
    if not callable(getattr(mesh, "_flatten", None)):
        raise _missing("DeviceMesh._flatten", f"the data-parallel mesh {name!r} is built with")
    return mesh._flatten(name)


def link_path_without_spaces() -> Optional[str]:
    """Where a JIT-built extension links against torch's libraries, made safe for a path
    with a space; call it before DeepSpeed joins the process group.

    ``torch.utils.cpp_extension`` writes ``-L{TORCH_LIB_PATH}`` unquoted into the ninja file
    of a JIT build (read on 2.11 and 2.13), so in a checkout whose path holds a space (its
    .venv with it) the linker gets two words and DeepSpeed's CPU communication op
    (deepspeed_shm_comm, built as DeepSpeed joins the group) fails to build. There, that
    module constant is pointed at a symlink to torch's lib directory in the temporary
    directory. The path the build links against then, or None (torch's own, unchanged)."""
    import hashlib
    import os
    import tempfile

    from torch.utils import cpp_extension

    lib = getattr(cpp_extension, "TORCH_LIB_PATH", None)
    if not isinstance(lib, str) or not any(ch.isspace() for ch in lib):
        return None
    link = os.path.join(tempfile.gettempdir(), f"sto-torch-lib-{hashlib.sha1(lib.encode()).hexdigest()[:12]}")
    if any(ch.isspace() for ch in link):
        raise DeviceError(f"torch's libraries ({lib}) and the temporary directory ({tempfile.gettempdir()}) both "
                          "have a space in their path, where DeepSpeed's CPU op cannot be linked; set TMPDIR to a "
                          "directory without one")
    try:
        os.symlink(lib, link)
    except FileExistsError:  # another rank's, or an earlier run's: the same target (the name is its hash)
        pass
    cpp_extension.TORCH_LIB_PATH = link
    return link


def checkpoint_wrapper(module: torch.nn.Module, preserve_rng_state: bool) -> torch.nn.Module:
    """torch's activation-checkpoint wrapper of ``module`` (non-reentrant)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    except ImportError:
        raise _missing("torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
                       "activation checkpointing (strategy.activation_checkpointing) uses") from None
    return wrap(module, preserve_rng_state=preserve_rng_state)


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor where it is the pending result of a functional collective
    (``AsyncCollectiveTensor``: the tensor-parallel embedding's reduce-scatter, with
    ``use_local_output``), through one op that waits for it (a copy: autograd intact);
    ``t`` itself otherwise. Given such a tensor as its input, a compiled block on torch 2.13
    passed no gradient back (seen on CPU/gloo, 2026-11-27: a TP model with compiled blocks
    left its embedding's gradient at zero, so the embedding never trained; 2.11 gave the
    eager gradient), and the first block compiled twice (seen on 2.13; pytorch#187073: that
    input and a plain one guard apart). Blocks get a plain tensor instead."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:  # a release without it has no such tensor to settle
        return t
    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


#: The first release on which compiled, activation-checkpointed tensor-parallel blocks fail
#: (:func:`refuse_compiled_tp_checkpointing`); 2.11 runs them.
COMPILED_TP_AC_FAILS: Tuple[int, int] = (2, 13)


def refuse_compiled_tp_checkpointing(compiled: bool, tensor_parallel: bool, checkpointed: bool,
                                     version: Optional[str] = None, host: Optional[str] = None) -> None:
    """Refuse (:class:`UnsupportedTorch`, one line, at the build) ``strategy.compile`` with
    tensor parallel and activation checkpointing on torch >= 2.13: its AOTAutograd fails in a
    checkpointed TP block's first backward ("expected all tensors_saved_with_vc_check to be
    Tensors": a DeviceMesh among the saved values; seen on 2.13 CPU/gloo, 2026-11-27, not on
    2.11). Newer releases are refused until one is tested."""
    text = str(torch.__version__) if version is None else version
    if not (compiled and tensor_parallel and checkpointed) or torch_version(text) < COMPILED_TP_AC_FAILS:
        return
    raise UnsupportedTorch(
        f"{host or socket.gethostname()}: torch {text}: strategy.compile=true with tensor parallel and activation "
        f"checkpointing fails in its AOTAutograd from {_text(COMPILED_TP_AC_FAILS)} on (a checkpointed TP block's "
        f"saved values hold a DeviceMesh; {_text(FLOOR)} runs it): set strategy.activation_checkpointing=none or "
        f"strategy.compile=false, or use torch {_text(FLOOR)}")


def all_gather_into(out: torch.Tensor, local: torch.Tensor, group=None) -> None:
    """Every rank's ``local`` (same shape everywhere) into the contiguous ``out`` of shape
    (world, \\*local.shape), in rank order: one collective, no tensor a rank. Public
    ``all_gather_single`` where the release has it (2.13 deprecates its old name,
    ``all_gather_into_tensor``, with a FutureWarning); that old name on 2.11. Both get the
    flat form, the only one gloo's CPU allgather takes (the stacked one: "invalid tensor
    size"); checked on gloo and the fake backend on 2.11 and 2.13."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), local.reshape(-1), group=group)


# ---- private torch and DeepSpeed, one function each ----------------------------------------

def foreach_copy(dsts, srcs, non_blocking: bool = False) -> None:
    """``torch._foreach_copy_(dsts, srcs)``: every ``dst.copy_(src)`` of two lists in one op
    that runs without the GIL (the async checkpoint's snapshot, on the checkpoint thread,
    so the training thread is not held up). No public equivalent: a Python loop of
    ``Tensor.copy_`` holds the GIL between copies. Read on 2.13; the floor's tests run it on
    2.11 (tests/test_checkpoint_snapshot.py). A release without it gets that loop (the
    same copies)."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(dsts, srcs, non_blocking=non_blocking)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=non_blocking)


def host_dtensor(local: torch.Tensor, like) -> torch.Tensor:
    """A DTensor whose shard is ``local`` (a host copy of DTensor ``like``'s shard) with
    ``like``'s sharding spec (mesh, placements, global shape and strides): the constructor
    ``DTensor(local, like._spec, requires_grad=False)``, "not a public API" says its
    docstring (2.13). The public ``DTensor.from_local`` moves ``local`` to the mesh's
    device (a GPU), where the snapshot must stay on the host. Read on 2.13; the floor's
    tests run it on 2.11 (tests/test_checkpoint_snapshot.py)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def set_allocator_settings(conf: str) -> None:
    """``torch.cuda.memory._set_allocator_settings(conf)``: the caching allocator's
    ``PYTORCH_ALLOC_CONF`` applied now. The public way is the variable itself, which torch
    reads once, at its first CUDA allocation or earlier (an import that touched CUDA): a
    value set after that would be ignored. Read on 2.13."""
    torch.cuda.memory._set_allocator_settings(conf)


def record_memory_history(max_entries: int) -> None:
    """``torch.cuda.memory._record_memory_history(max_entries=..., stacks="python")``: the
    CUDA caching allocator's history, its last ``max_entries`` events with Python stacks.
    torch's own memory guide (https://pytorch.org/docs/stable/torch_cuda_memory.html)
    documents it under this name: there is no public one (read on 2.13)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop_memory_history() -> None:
    """Stop :func:`record_memory_history`'s recording (``enabled=None``, as torch's memory
    guide says)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """``torch.cuda.memory._dump_snapshot(path)``: the recorded history pickled to ``path``,
    for https://pytorch.org/memory_viz. Public ``torch.cuda.memory_snapshot()`` has the
    segments but not the history's trace, nor the file memory_viz reads (read on 2.13)."""
    torch.cuda.memory._dump_snapshot(path)


def nccl_trace() -> Optional[bytes]:
    """NCCL's flight recorder now (pickled: its last collectives, with stacks), from
    ``torch._C._distributed_c10d._dump_nccl_trace``; None where the build has none. The
    public way (``TORCH_NCCL_DUMP_ON_TIMEOUT``) writes only when NCCL's own watchdog fires,
    not when ours does. The binding is in torch's CUDA builds only: the CPU build of 2.13
    here has none (only the generic ``_dump_fr_trace``), hence the None."""
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    return bytes(dump(includeCollectives=True, includeStackTraces=True, onlyActive=False))


def live_process_groups() -> list:
    """Every process group alive now (``distributed_c10d._world.pg_map``'s keys, the
    default group among them); [] where that registry is not there. No public list of
    them: ``destroy_process_group()`` with no argument destroys these (read on 2.13)."""
    from torch.distributed import distributed_c10d

    return list(getattr(getattr(distributed_c10d, "_world", None), "pg_map", {}))


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (the optimizer's constructor does, ~1 s), so that a process
    that forks ranks imports it once. Public ``torch.compiler`` imports it lazily, so no
    public import does it (read on 2.13)."""
    import torch._dynamo  # noqa: F401


def fake_process_group(rank: int, world_size: int) -> None:
    """Join a fresh ``fake`` process group as ``rank`` of ``world_size`` (any group before
    it destroyed): every collective answered locally, so one process plays one rank of a
    large job (tests and bench only). The backend and its store are in torch's own test
    support, ``torch.testing._internal.distributed.fake_pg``, which registers "fake" when
    imported; no public fake backend exists (read on 2.13)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def zero_init_without_broadcast(config):
    """``deepspeed.zero.Init(config_dict_or_path=config)`` without its broadcast of every new
    parameter from rank 0: its private ``_zero_init_param`` (which broadcasts, so that the
    ranks' random module inits agree, writing the whole parameter on every rank) replaced
    by its two other steps, ``_convert_to_deepspeed_param`` and ``param.partition()``. Each
    rank fills its own partition afterwards (train/strategies/deepspeed.py
    ``fill_partitioned``), so the whole parameter is never resident. DeepSpeed has no
    public switch for it. Read on DeepSpeed 0.19.8; both methods are checked to exist, so
    an upgrade that renames them fails here, naming the version."""
    import deepspeed

    base = deepspeed.zero.Init
    if not all(callable(getattr(base, m, None)) for m in ("_zero_init_param", "_convert_to_deepspeed_param")):
        raise RuntimeError(f"deepspeed {deepspeed.__version__}: zero.Init has no _zero_init_param / "
                           "_convert_to_deepspeed_param; train/torch_compat.py zero_init_without_broadcast "
                           "needs updating")

    class NoBroadcastInit(base):
        def _zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

    return NoBroadcastInit(config_dict_or_path=config)
