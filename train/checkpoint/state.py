"""What a checkpoint holds besides the files an engine writes itself: the Stateful pieces.

- model + optimizer: :class:`AppState`, DCP's Stateful over an engine
  (:class:`train.strategies.base.DCPEngine`: ``state_dict`` / ``load_state_dict``);
- step, data-loader position and RNG states: one ``extra_rank{R}.pt`` per rank
  (:func:`write_extra` / :func:`load_extra`).
"""
from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from train.checkpoint.manifest import Sums, crc32

# The keys of the optimizer's hyperparameters (lr, betas, weight decay) in an engine's
# flattened optimizer state (torch's StateDictOptions(flatten_optimizer_state_dict=True)).
HYPERPARAMETERS = "param_groups."


class AppState:
    """DCP Stateful over an engine's model + optimizer state.

    ``loading``: what a load asks of the checkpoint leaves out the optimizer's
    hyperparameters (:data:`HYPERPARAMETERS`), which the engine keeps from the run config
    (as the universal DeepSpeed load does: a resume keeps the run's own). The states' keys are the same whether the optimizer
    state was saved flattened (now) or nested (checkpoints of earlier versions), so those
    load too."""

    def __init__(self, engine, loading: bool = False) -> None:
        self.engine = engine
        self.loading = loading

    def state_dict(self) -> Dict[str, Any]:
        state = self.engine.state_dict()
        if self.loading:
            state = {**state, "optim": {k: v for k, v in state["optim"].items() if not k.startswith(HYPERPARAMETERS)}}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.engine.load_state_dict(state)


def rng_state() -> Dict[str, Any]:
    """The generators of this rank; CUDA's (of the current device: the rank's own, set by
    the harness) only where this process uses CUDA. ``is_available()`` would be true for a
    CPU profile on a GPU node too, and asking for the state would open a CUDA context on
    GPU 0 for every rank there."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def extra_name(rank: int) -> str:
    return f"extra_rank{rank}.pt"


def write_extra(root: Path, rank: int, step: int, extra: Dict[str, Any], fsync: bool = True) -> Sums:
    """This rank's step, RNG states and ``extra`` (the loader position) under ``root``;
    its manifest entry, summed as written."""
    buf = io.BytesIO()
    torch.save({"step": step, "rng": rng_state(), **extra}, buf)
    data = buf.getbuffer()
    rel = extra_name(rank)
    with open(root / rel, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return {rel: [len(data), crc32(data)]}


def load_extra(ckpt: Path, rank: int, same_layout: bool = True) -> Dict[str, Any]:
    """This rank's extra state, its RNG states restored. Resumed on another layout (world
    size, data-parallel, tensor or pipeline degree: ``same_layout`` false) every rank takes
    rank 0's: the step and loader position are the same in every file, and the RNG states
    are then the same on every rank, as at a fresh start (each rank seeds train.seed); rank
    ``r``'s own stream would belong to another role. The training draws random numbers
    only for LoRA's dropout (``peft.dropout`` > 0): resumed on the same layout it draws as
    the uninterrupted run would, on another its masks differ from there on."""
    path = ckpt / extra_name(rank)
    if not same_layout or not path.exists():
        path = ckpt / extra_name(0)
    extra = torch.load(path, weights_only=False)  # numpy's RNG state is not a weights-only type
    set_rng_state(extra["rng"])
    return extra
