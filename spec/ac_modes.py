"""Activation checkpointing modes (``strategy.activation_checkpointing``): the one table
that the trainer (train/parallelize.py), the validator and the planner read.

A mode says which transformer blocks are recomputed in backward: a recomputed block keeps
only its input from forward to backward and runs its forward again. None of them is
torch's op-level selective activation checkpointing (torchtitan's "selective op", which
keeps the matmul outputs of every block); the planner models that one for its
comparisons only (``launcher.plan.memory.OP_SAC``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from spec.config import ConfigError


@dataclass(frozen=True)
class AcMode:
    name: str
    stride: int  # blocks 0, stride, 2 x stride, ... are recomputed; 0: none
    what: str

    def recomputes(self, block: int) -> bool:
        """Whether block ``block`` (0-based) is recomputed in backward."""
        return self.stride > 0 and block % self.stride == 0

    def blocks(self, layers: int) -> int:
        """How many of ``layers`` blocks are recomputed."""
        return -(-layers // self.stride) if self.stride else 0

    @property
    def share(self) -> float:
        """The share of the blocks recomputed, over many blocks: 0, 1/2, 1."""
        return 1.0 / self.stride if self.stride else 0.0


MODES: Dict[str, AcMode] = {m.name: m for m in (
    AcMode("none", 0, "no recomputation: every block keeps its activations"),
    AcMode("every_other", 2, "blocks 0, 2, 4, ... recomputed in backward"),
    AcMode("full", 1, "every block recomputed in backward"),
)}
# Old names that keep working. "selective" was this project's name for every_other, not
# torch's op-level selective checkpointing.
ALIASES: Dict[str, str] = {"selective": "every_other"}
NAMES: Tuple[str, ...] = (*MODES, *ALIASES)  # what the field accepts


def ac_mode(name: str) -> AcMode:
    """The mode of ``name`` (an alias gives its mode); ConfigError for an unknown one."""
    try:
        return MODES[ALIASES.get(name, name)]
    except KeyError:
        raise ConfigError(f"strategy.activation_checkpointing={name!r}: not a mode; choose one of "
                          f"{', '.join(NAMES)}") from None
