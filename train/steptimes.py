"""Where each step's time goes, on every rank, and which rank is slow (with the profiler of
train/profiling.py and the stacks on demand, one of the ways to see inside a run).

Each rank times its step in four parts, cheaply (a few ``perf_counter`` calls; on CUDA
three events whose times are read after the step's own sync):

- ``data_s``: the loader's batches for the step (what is left of it: the loop reads the
  next step's batches ahead, while the device runs this one, and that time is busy time);
- ``fwd_bwd_s``: forward and backward of every micro-batch (with the collectives inside
  them: FSDP's gathers, DDP's gradient all-reduce);
- ``optim_s``: grad-norm clipping and the optimizer step (the engine marks where it
  begins: :func:`mark_optimizer`);
- ``busy_s``: everything the rank did since the previous step's collective released it
  until it reached this step's (the three above, plus logging, evaluation, checkpoints).

The step's all-gather (train/loop.py) carries every rank's four numbers, so every rank
holds the same table. In a synchronous step every rank's total equals the slowest's: the
busy time is what tells them apart, and the rest is the wait at the collective
(``wait_s`` = slowest busy - own busy). Metrics rows get min / median / max of each (and
the rank of the max): :func:`spread`.

:class:`Stragglers` scores each rank as nvidia-resiliency-ext does, relative to a
reference (here the median of its peers, itself left out): score = median self time /
own self time, 1.0
as fast as the median, 0.5 twice as slow. A rank's *self time* is its busy time (which ends
where the wait at the step's collective begins) less its wait inside the engine,
estimated as its fwd_bwd_s less the least of its peers' (a rank late to DDP's gradient all-reduce makes the
others wait there: their fwd_bwd_s grows by its lateness, its own does not). Peers are
the ranks that do the same work: the same pipeline stage and tensor-parallel rank. A rank
is a straggler when its score stays under ``train.straggler_score`` with at least
``train.straggler_min_s`` more self time than the median for ``train.straggler_steps``
steps in a row; every rank runs the same detector on the same table, so all agree
without another message.

What it cannot see: a rank slower *inside* the engine's step, before an in-step
collective (a slow GPU under DDP or FSDP: its peers wait in the collective and every
rank's times grow alike). Host timing cannot tell that wait from work; the spread of
fwd_bwd_s in the metrics rows is all it shows.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

FIELDS = ("data_s", "fwd_bwd_s", "optim_s", "busy_s")  # what each rank sends, in this order
_active: Optional["StepClock"] = None


def mark_optimizer() -> None:
    """Called by an engine where its optimizer phase begins (after the last backward)."""
    if _active is not None:
        _active.mark_optimizer()


class StepClock:
    """One rank's clock of its steps. ``release()`` after each step's collective."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.released = time.perf_counter()
        self._t0 = self._t_data = self._t_opt = self._t_end = self.released
        self._events: List = []

    def begin(self) -> None:
        global _active
        _active = self
        self._t0 = time.perf_counter()

    def data_ready(self) -> None:
        self._t_data = self._t_opt = time.perf_counter()
        if self.cuda:
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self._events[0].record()

    def mark_optimizer(self) -> None:
        self._t_opt = time.perf_counter()
        if self.cuda and self._events:
            self._events[1].record()

    def computed(self) -> None:
        """The engine's step returned (on CUDA its kernels may still run)."""
        self._t_end = time.perf_counter()
        if self.cuda and self._events:
            self._events[2].record()

    def arrive(self) -> List[float]:
        """At the step's collective, after the step's values were read (a device sync):
        this rank's :data:`FIELDS`."""
        global _active
        _active = None
        now = time.perf_counter()
        data = self._t_data - self._t0
        if self.cuda and len(self._events) == 3:
            self._events[2].synchronize()
            opt_marked = self._t_opt > self._t_data
            total = self._events[0].elapsed_time(self._events[2]) / 1e3
            fwd_bwd = self._events[0].elapsed_time(self._events[1]) / 1e3 if opt_marked else total
            optim = total - fwd_bwd
        else:
            fwd_bwd = self._t_opt - self._t_data if self._t_opt > self._t_data else self._t_end - self._t_data
            optim = self._t_end - self._t_opt if self._t_opt > self._t_data else 0.0
        return [data, fwd_bwd, optim, now - self.released]

    def release(self) -> None:
        self.released = time.perf_counter()


def spread(values: Sequence[float]) -> Dict[str, float]:
    """min / median / max over ranks, and the rank of the max."""
    worst = max(range(len(values)), key=lambda r: values[r])
    return {"min": float(min(values)), "median": float(statistics.median(values)), "max": float(values[worst]),
            "max_rank": worst}


def breakdown(table: Sequence[Sequence[float]]) -> Dict[str, Dict[str, float]]:
    """Per field, :func:`spread` over ranks (rows: ranks; columns: :data:`FIELDS`), plus
    ``wait_s``, each rank's wait at the step's collective (slowest busy - own busy)."""
    columns = {name: [float(row[i]) for row in table] for i, name in enumerate(FIELDS)}
    slowest = max(columns["busy_s"])
    out = {name: spread(values) for name, values in columns.items()}
    out["wait_s"] = spread([slowest - b for b in columns["busy_s"]])
    return out


def self_times(table: Sequence[Sequence[float]], group: Sequence[int]) -> Dict[int, float]:
    """The self time of each rank of ``group`` (peers): busy less its waits (module text)."""
    i_fb, i_busy = FIELDS.index("fwd_bwd_s"), FIELDS.index("busy_s")
    least_fb = min(float(table[r][i_fb]) for r in group)
    return {r: float(table[r][i_busy]) - (float(table[r][i_fb]) - least_fb) for r in group}


@dataclass
class Stragglers:
    """Ranks persistently slower than their peers (see the module's text)."""

    score: float = 0.67  # train.straggler_score (0: off)
    steps: int = 10  # train.straggler_steps: in a row
    min_s: float = 0.05  # train.straggler_min_s: at least this much busier than the median
    streak: Dict[int, int] = field(default_factory=dict)
    flagged: Dict[int, Dict[str, float]] = field(default_factory=dict)

    groups: List[List[int]] = field(default_factory=list)  # peers; empty: all ranks

    def update(self, table: Sequence[Sequence[float]], step: int) -> List[int]:
        """Feed one step's table (rows: ranks; columns: :data:`FIELDS`); the ranks newly
        flagged at this step."""
        if self.score <= 0:
            return []
        new = []
        for group in self.groups or [list(range(len(table)))]:
            if len(group) < 2:
                continue
            own = self_times(table, group)
            others = medians_of_the_others([own[r] for r in group])
            for rank, median in zip(group, others):
                s = median / own[rank] if own[rank] > 0 else 1.0
                slow = s < self.score and own[rank] - median >= self.min_s
                self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
                if self.streak[rank] >= self.steps and rank not in self.flagged:
                    self.flagged[rank] = {"rank": rank, "step": step, "score": round(s, 3), "self_s": own[rank],
                                          "median_self_s": median, "steps_in_a_row": self.streak[rank]}
                    new.append(rank)
        return new


def medians_of_the_others(values: Sequence[float]) -> List[float]:
    """For each value, the median of all the others: one sort, not one per rank (a job of
    thousands of ranks runs this every step)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranked = [values[i] for i in order]
    n, out = len(values) - 1, [0.0] * len(values)

    def kth(k: int, gone: int) -> float:  # the k-th smallest once position ``gone`` is removed
        return ranked[k] if k < gone else ranked[k + 1]

    for position, i in enumerate(order):
        m = n // 2
        out[i] = kth(m, position) if n % 2 else (kth(m - 1, position) + kth(m, position)) / 2
    return out


def peers(layout) -> List[List[int]]:
    """Ranks that do the same work each step (spec.layout.Layout): the same pipeline stage
    and tensor-parallel rank, across the data-parallel ranks."""
    groups: Dict[tuple, List[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        groups.setdefault((c.get("pp", 0), c.get("tp", 0)), []).append(rank)
    return list(groups.values())
