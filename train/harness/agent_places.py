"""Which node trains in which place when the job holds hot spares, and the agents' marks.

With node agents and ``cluster.spare_nodes=K`` the step's srun starts an agent on every
node of the job's N+K (slurm/step_loop.sh exports :data:`PLACES_ENV` = N): the first N
nodes of the step's node list train, the others wait warm, their imports done. A restart
that drops nodes (RESTART's ``exclude=``: every node this job dropped) gives each dropped
node's place to the first spare left, in the node list's order; every agent computes the
same places from the same three facts (:func:`places`), so no one hands them out. The
agents that were training fork fresh ranks from their warm state and the spare forks its
node's ranks: no agent starts cold. Each rank sees the places as its step's nodes
(SLURM_NODEID = its place, the node list in place order: the master is place 0's node).

Marks for the step loop, in such an srun only, in ``RUN_DIR/.agents/`` (emptied before
each srun): ``NODE.up`` when a node's agent starts, ``NODE.end`` (its exit status) when it
ends. A dead node's task never ends for srun until Slurm declares the node DOWN
(SlurmdTimeout): once every agent of the srun that is not on a dropped node has ended,
the loop ends the srun itself with the worst of their statuses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional, Sequence

PLACES_ENV = "STO_AGENT_PLACES"  # the training nodes of the step, when its srun also holds spares
AGENTS_DIR = ".agents"


def places(hosts: Sequence[str], n: int, dropped: Iterable[str]) -> Optional[List[str]]:
    """The ``n`` training nodes in place order: the first ``n`` of ``hosts`` (the srun's node
    list), each one in ``dropped`` replaced by the first of the others not dropped nor
    already placed; None when too few are left."""
    gone = set(dropped)
    out = list(hosts[:n])
    free = [h for h in hosts[n:] if h not in gone]
    for i, host in enumerate(out):
        if host in gone:
            if not free:
                return None
            out[i] = free.pop(0)
    return out


def dropped_of(exclude: str) -> List[str]:
    """RESTART's ``exclude=`` line as node names."""
    return [h for h in exclude.split(",") if h]


def mark(run_dir: str, node: str, what: str, text: str = "") -> None:
    """``RUN_DIR/.agents/NODE.WHAT`` (``up`` or ``end``) with ``text``, written whole."""
    folder = Path(run_dir) / AGENTS_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{node}.{what}.tmp"
    tmp.write_text(text)
    tmp.replace(folder / f"{node}.{what}")


def ended(run_dir: str, nodes: Iterable[str]) -> bool:
    """Every agent of ``nodes`` has ended (its ``end`` mark)."""
    folder = Path(run_dir) / AGENTS_DIR
    return all((folder / f"{node}.end").exists() for node in nodes)
