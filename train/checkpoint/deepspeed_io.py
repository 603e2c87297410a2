"""DeepSpeed's own checkpoint files, through the engine protocol's native capability
(:class:`train.strategies.base.NativeEngine`: ``save_native``, ``load_native``): the
checkpoint backend of DeepSpeed runs (:class:`DeepSpeedBackend`).

DeepSpeed writes every model and optimizer file through its engine's checkpoint engine
(``checkpoint_engine.save(state, path)``). For the time of a save that is replaced
(:func:`summed_files`, called by :meth:`train.strategies.deepspeed.DeepSpeedEngine.save_native`)
by one that ``torch.save``-s into a stream summing the bytes as they are written (CRC32
and size, the manifest's entry) and fsyncs the file; DeepSpeed's recovery scripts, which
rank 0 copies beside the tag, are summed from the package's own copy. Each rank leaves
its entries in its side file, so the commit reads nothing back (a file summed by no one
would still be read back there: :func:`train.checkpoint.manifest.save_plan`). DeepSpeed
reads its files itself, so they are verified in full before a load
(:func:`train.checkpoint.manifest.verify`).

Resumed at another data-parallel size or ZeRO stage (``launcher.resume RUN_DIR
cluster.nodes=M``), a ZeRO checkpoint does not load as it is (DeepSpeed refuses a DP
world size other than the saved one): rank 0 converts it once into DeepSpeed's
universal format (``deepspeed.checkpoint.ds_to_universal``, in process, into
``checkpoints/universal/step_N/``, beside the committed directory, which stays as it
was), and the engine, built with ``"checkpoint": {"load_universal": true}``
(:func:`spec.ds_config.deepspeed_config`, ``checkpoint.load_universal``), loads that,
at any ZeRO stage (:func:`for_stage` adds what the new stage's loader reads).
"""
from __future__ import annotations

import functools
import io
import json
import os
import shutil
from argparse import Namespace
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from spec.rundir import needs_universal
from train.checkpoint.dcp_writer import SummingStream
from train.checkpoint.manifest import Sums, Survey, crc32, fsync_path

if TYPE_CHECKING:
    from train.strategies.base import NativeEngine

SUBDIR = "deepspeed"
TAG = "state"  # the tag DeepSpeedEngine.save_native / load_native use
UNIVERSAL = "universal"  # checkpoints/universal/step_N: a step converted to the universal format


@dataclass
class DeepSpeedBackend:
    """DeepSpeed's engine writes and reads its own files (``deepspeed/``): each summed as it
    is written by the rank that writes it, none as it is read (all are verified before a
    load); always a blocking save. Resumed at another data-parallel size or ZeRO stage, the
    engine loads the universal format."""

    rank: int
    shape: Mapping[str, Any] = field(default_factory=dict)  # this run's (spec.rundir.run_shape)
    universal: bool = False  # the engine was built to load the universal format (plan_load)
    format: ClassVar[str] = SUBDIR  # "deepspeed": train.strategies.base.NativeEngine
    saves_async: ClassVar[bool] = False
    loads_in_place: ClassVar[bool] = False  # verified before: a rejected load read nothing

    def save(self, engine: NativeEngine, tmp: Path, side: Path, sums: Sums, saver=None) -> None:
        """The engine's files under ``tmp``, fsynced; ``sums`` and the entries of the files
        this rank wrote (summed as written: ``save_native``'s answer) left in ``side`` for
        the manifest. Collective. (No ``saver``: never async.)"""
        written = engine.save_native(tmp / SUBDIR) or {}  # None: read back at the commit
        side.write_text(json.dumps({**sums, **{str(Path(SUBDIR) / rel): v for rel, v in written.items()}}))

    def summed_on_load(self, rel: str) -> bool:
        """No file is summed as it is loaded: DeepSpeed reads them itself, all verified first."""
        return False

    def plan_load(self, saved: Optional[Mapping[str, Any]]) -> bool:
        """Whether the engine must be built to load the universal format: the newest
        checkpoint (its shape ``saved``) is a ZeRO one of another data-parallel size or stage."""
        self.universal = needs_universal(saved, self.shape)
        return self.universal

    def load(self, engine: NativeEngine, ckpt: Path, found: Survey) -> Optional[str]:
        """DeepSpeed's files of ``ckpt``, converted to the universal format first when it
        was saved at another shape (``found.shape``: rank 0's survey's; rank 0 converts;
        collective)."""
        universal = needs_universal(found.shape, self.shape)
        if universal != self.universal:  # the engine was built for the newest checkpoint's shape
            return (f"saved at another shape than the newest checkpoint (universal load: {universal}); "
                    f"resume once more to load it")
        if universal:
            reason = [to_universal(ckpt, self.shape["zero_stage"]) if self.rank == 0 else None]
            dist.broadcast_object_list(reason, src=0)
            if reason[0] is not None:
                return reason[0]
        load(engine, ckpt, universal)
        return None


class _SummedFile(SummingStream):
    """A file ``torch.save`` writes into, its CRC32 and size following the bytes handed to
    ``write``. No ``fileno``: torch.save's legacy (non-zip) format would write the tensors'
    bytes straight to the descriptor, past ``write`` and the sum."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


def save_summed(state: Any, path: Path, zipfile: bool = True) -> List[int]:
    """``torch.save(state, path)`` as DeepSpeed's ``TorchCheckpointEngine.save`` does it
    (``zipfile``: its ``_use_new_zipfile_serialization``), fsynced: the file's manifest
    entry [size, CRC32], of the bytes as they were written."""
    with open(path, "wb") as raw:
        stream = _SummedFile(raw)
        torch.save(state, stream, _use_new_zipfile_serialization=zipfile)
        raw.flush()
        os.fsync(raw.fileno())
    return [stream.size, stream.crc]


class SummingCheckpointEngine:
    """DeepSpeed's ``TorchCheckpointEngine`` whose ``save`` is :func:`save_summed`, each
    file's entry kept in ``sums`` under the path DeepSpeed gave; everything else
    (``create``, ``makedirs``, ``commit``, ``load``, ...) is DeepSpeed's own."""

    def __init__(self, inner, sums: Sums) -> None:
        self.inner, self.sums = inner, sums

    def save(self, state_dict: Any, path: str) -> None:
        self.sums[os.fspath(path)] = save_summed(state_dict, Path(path), self.inner.zipfile_serialization)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextmanager
def summed_files(ds, root: Path) -> Iterator[Sums]:
    """While DeepSpeed's engine ``ds`` saves under ``root`` (``save_checkpoint(root, ...)``
    in the block), every file it writes is summed as written and fsynced; the dict yielded
    holds, once the block ends, their entries by path relative to ``root`` (on global rank
    0 with its recovery scripts': :func:`recovery_scripts`)."""
    from deepspeed import __version__
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    # The one DeepSpeed attribute touched: DeepSpeedEngine.checkpoint_engine, through which
    # save_checkpoint (0.19: _save_checkpoint, _save_zero_checkpoint, _save_moe_checkpoint)
    # writes every model and optimizer file (``.save(state, path)``). It is replaced for the
    # save, so each file is summed from the bytes as they are written, not read back. Only
    # DeepSpeed's plain torch.save engine is replaced (another, e.g. the fast or decoupled
    # writer of a ``checkpoint.writer`` config, writes its own way): anything else fails here.
    inner = getattr(ds, "checkpoint_engine", None)
    if type(inner) is not TorchCheckpointEngine or not hasattr(inner, "zipfile_serialization"):
        raise RuntimeError(f"deepspeed {__version__}: the engine's checkpoint_engine is {type(inner).__name__}, not "
                           "TorchCheckpointEngine with zipfile_serialization; train/checkpoint/deepspeed_io.py "
                           "summed_files needs updating")
    written: Sums = {}
    sums: Sums = {}
    ds.checkpoint_engine = SummingCheckpointEngine(inner, written)
    try:
        yield sums
    finally:
        ds.checkpoint_engine = inner
    for path, entry in written.items():
        rel = os.path.relpath(path, root)
        if not rel.startswith(os.pardir):  # (a file outside the checkpoint is none of its own)
            sums[rel] = entry
    if dist.get_rank() == 0:
        sums.update(recovery_scripts(root))


# Copied by DeepSpeed 0.19 on global rank 0 into the save directory (shutil.copyfile, outside
# its checkpoint engine: DeepSpeedEngine._copy_recovery_script) from deepspeed/utils/.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def recovery_scripts(root: Path) -> Sums:
    """The entries of DeepSpeed's recovery scripts copied under ``root``, fsynced: each
    summed from its source, the package's file it is a copy of (read once a process; the
    checkpoint's copy is not read: one that differs fails verification before a load). A
    copy not of its source's size is left out (read back at the commit)."""
    import deepspeed

    sums: Sums = {}
    for name in RECOVERY_SCRIPTS:
        copy, source = root / name, Path(deepspeed.__file__).parent / "utils" / name
        if not (copy.is_file() and source.is_file()):
            continue
        stat = source.stat()
        entry = list(_file_sum(str(source), stat.st_size, stat.st_mtime_ns))
        if copy.stat().st_size == entry[0]:
            _fsync_written(copy)
            sums[name] = entry
    return sums


@functools.lru_cache(maxsize=None)
def _file_sum(path: str, size: int, mtime_ns: int) -> Tuple[int, int]:
    """(size, CRC32) of a file (of that size and time: read again if it changed)."""
    data = Path(path).read_bytes()
    return len(data), crc32(data)


def _fsync_written(path: Path) -> None:
    """fsync a file another writer wrote, through a write-only descriptor (nothing is read;
    a read-only one where the file may not be opened for writing)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except PermissionError:
        fsync_path(path)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(engine: NativeEngine, ckpt: Path, universal: bool = False) -> None:
    """Read the engine's files of a checkpoint verified beforehand (``universal``: its
    conversion, made by :func:`to_universal`). Collective.

    A universal load keeps the engine's per-group hyperparameters (the run config's):
    DeepSpeed 0.19's ZeRO-3 universal loader copies the first parameter group's onto
    every group, which gave the norms and biases (no weight decay) the matrices' weight
    decay. It also gives every sub-group's state one and the same ``step`` tensor, which
    torch's AdamW then advances in place once per sub-group and step: the bias correction
    ran ahead and the resumed loss drifted 1e-2 from the uninterrupted run's in 6 steps.
    Each state gets its own copy."""
    if not universal:
        engine.load_native(ckpt / SUBDIR)
        return
    groups = [opt.param_groups for opt in engine.optimizers]
    kept = [[{k: v for k, v in g.items() if k != "params"} for g in gs] for gs in groups]
    engine.load_native(universal_dir(ckpt))
    for gs, hyper in zip([opt.param_groups for opt in engine.optimizers], kept):
        if len(gs) == len(hyper):
            for group, values in zip(gs, hyper):
                group.update(values)
    for opt in engine.optimizers:
        for state in getattr(opt, "optimizer", opt).state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def universal_dir(ckpt: Path) -> Path:
    return ckpt.parent / UNIVERSAL / ckpt.name


def to_universal(ckpt: Path, stage: int, workers: int = 1) -> Optional[str]:
    """Convert ``ckpt``'s DeepSpeed files (once: an earlier conversion is reused) and make
    them loadable at ZeRO ``stage`` (:func:`for_stage`); the reason it failed, or None.
    Into a temporary directory renamed when complete. ``workers``: the converter's process
    pools (1 inside the training job: no pool forked from a process with live gloo
    threads; :mod:`train.checkpoint.convert`, a process of its own, uses every CPU)."""
    out = universal_dir(ckpt)
    if not (out / TAG).is_dir():
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            from deepspeed.checkpoint.ds_to_universal import main as convert

            # inject_missing_state: our engine saves no universal_checkpoint_info (no TP/PP
            # patterns to record), which the converter otherwise insists on.
            convert(Namespace(input_folder=str(ckpt / SUBDIR / TAG), output_folder=str(tmp / TAG),
                              num_extract_workers=workers, num_merge_workers=workers, keep_temp_folder=False,
                              strict=True, inject_missing_state=True))
        except Exception as exc:  # noqa: BLE001 - reported by every rank, the checkpoint skipped
            shutil.rmtree(tmp, ignore_errors=True)
            return f"conversion to DeepSpeed's universal checkpoint failed: {type(exc).__name__}: {exc}"
        tmp.rename(out)
    for_stage(out / TAG, stage)
    return None


MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 1-2, 3


def for_stage(tag_dir: Path, stage: int) -> None:
    """Make a conversion load at ZeRO ``stage``, whichever stage saved it.

    DeepSpeed 0.19's converter writes what the saving stage's loader reads, and the two
    loaders read different things (weights and optimizer states come from ``zero/``, the
    step counters from the model-states file):

    - the model-states file is ``mp_rank_00_...`` under stages 1-2 and ``zero_pp_rank_0_...``
      under stage 3 (a link of the other name is added);
    - ``zero/optimizer_state.pt``: stage 3 reads the step of ``optimizer_state_dict``, stages
      1-2 ``ds_version``; each gets the other's (the step alone, not rank 0's moments);
    - each parameter's ``fp32``/``exp_avg``/``exp_avg_sq``: stages 1-2 read
      ``{"cat_dim", "param"}`` at the parameter's shape and a ``step.pt`` beside them;
      stage 3 reads that or the bare flat tensor it writes itself. Only a stage 1-2 load of
      a ZeRO-3 conversion rewrites them (a pass over the states; ``step.pt``, written
      last, marks a parameter done), so a ZeRO-3 reshape costs no more than the conversion.
    All steps are idempotent: a conversion is reused by later loads at any stage."""
    present = [n for n in MODEL_STATES if (tag_dir / n).is_file()]
    if not present:
        return
    for name in MODEL_STATES:
        if not (tag_dir / name).exists():
            (tag_dir / name).symlink_to(present[0])
    path = tag_dir / "zero" / "optimizer_state.pt"
    opt = torch.load(path, map_location="cpu", weights_only=False)
    # mmap: under stages 1-2 the file also holds the whole model, of which only the shapes are read
    states = torch.load(tag_dir / present[0], map_location="cpu", weights_only=False, mmap=True)
    shapes = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    inner = opt.get("optimizer_state_dict")
    step = inner["state"][0]["step"] if inner else torch.load(tag_dir / "zero" / next(iter(shapes)) / "step.pt",
                                                                weights_only=False)
    if stage in (1, 2):
        for name, shape in shapes.items():
            folder = tag_dir / "zero" / name
            if (folder / "step.pt").exists():
                continue
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                value = torch.load(folder / f"{key}.pt", map_location="cpu", weights_only=False)
                if torch.is_tensor(value):  # else rewritten by a load that stopped before step.pt
                    _save({"cat_dim": 0, "param": value.view(shape)}, folder / f"{key}.pt")
            _save(step, folder / "step.pt")
    if set(opt.get("optimizer_state_dict", {}).get("state", {}).get(0, {})) != {"step"} or "ds_version" not in opt:
        opt["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": opt["param_groups"]}
        opt.setdefault("ds_version", states.get("ds_version"))
        _save(opt, path)


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` that a kill leaves whole or not written (a conversion is reused)."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
