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

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

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
    """min / median / max over ranks, and the rank of the max (the first, on a tie)."""
    return _spreads(torch.as_tensor(values, dtype=torch.float64)[None])[0]


def _spreads(columns: torch.Tensor) -> List[Dict[str, float]]:
    """:func:`spread` of each row of ``columns`` (rows: fields; columns: ranks), in C: a
    quickselect per order statistic, no sort and no Python float a rank. The median is
    ``statistics.median``'s: the middle value, or the mean of the two middle ones, added
    and halved in Python as it does, so every figure is the one a list of floats gives
    (times are finite: a NaN would order differently)."""
    n = columns.shape[1]
    middle = [columns.kthvalue(k, dim=1).values for k in ((n // 2, n // 2 + 1) if n % 2 == 0 else (n // 2 + 1,))]
    found = torch.stack([columns.amin(dim=1), columns.amax(dim=1), columns.argmax(dim=1).to(columns.dtype)]
                        + middle).tolist()
    out = []
    for f, (low, high, worst) in enumerate(zip(*found[:3])):
        median = found[3][f] if n % 2 else (found[3][f] + found[4][f]) / 2
        out.append({"min": low, "median": median, "max": high, "max_rank": int(worst)})
    return out


def as_table(table: Union[torch.Tensor, Sequence[Sequence[float]]]) -> torch.Tensor:
    """A step's times table (rows: ranks; columns: :data:`FIELDS`) as a float64 CPU tensor:
    the loop's own (train/loop.py ``Agreed.times``) as is, a list of rows copied."""
    return torch.as_tensor(table, dtype=torch.float64, device="cpu")


def breakdown(table: Union[torch.Tensor, Sequence[Sequence[float]]]) -> Dict[str, Dict[str, float]]:
    """Per field, :func:`spread` over ranks (rows: ranks; columns: :data:`FIELDS`), plus
    ``wait_s``, each rank's wait at the step's collective (slowest busy - own busy)."""
    t = as_table(table)
    busy = t[:, FIELDS.index("busy_s")]
    columns = torch.cat([t.T, (busy.max() - busy)[None]])
    return dict(zip(FIELDS + ("wait_s",), _spreads(columns)))


def self_times(table: Union[torch.Tensor, Sequence[Sequence[float]]], group: Sequence[int]) -> Dict[int, float]:
    """The self time of each rank of ``group`` (peers): busy less its waits (module text)."""
    own = _self_times(as_table(table)[list(group)][None])[0]
    return dict(zip(group, own.tolist()))


def _self_times(rows: torch.Tensor) -> torch.Tensor:
    """:func:`self_times` of groups of peers of one size: ``rows`` (groups, size, FIELDS)."""
    fwd_bwd, busy = rows[..., FIELDS.index("fwd_bwd_s")], rows[..., FIELDS.index("busy_s")]
    return busy - (fwd_bwd - fwd_bwd.amin(dim=-1, keepdim=True))


@dataclass
class _Batch:
    """The groups of peers of one size, at their positions in :attr:`Stragglers.groups`;
    ``rows``: their ranks, the rows of the table to gather (None: the table's own rows
    already are these groups in order, a view suffices); ``streak``: (groups, size), the
    steps in a row each was slow."""

    positions: List[int]
    ranks: List[List[int]]
    rows: Optional[torch.Tensor]
    streak: torch.Tensor

    def times(self, t: torch.Tensor) -> torch.Tensor:
        shape = self.streak.shape + (t.shape[1],)
        return t.reshape(shape) if self.rows is None else t.index_select(0, self.rows).view(shape)


@dataclass
class Stragglers:
    """Ranks persistently slower than their peers (see the module's text)."""

    score: float = 0.67  # train.straggler_score (0: off)
    steps: int = 10  # train.straggler_steps: in a row
    min_s: float = 0.05  # train.straggler_min_s: at least this much busier than the median
    flagged: Dict[int, Dict[str, float]] = field(default_factory=dict)

    groups: List[List[int]] = field(default_factory=list)  # peers, disjoint; empty: all ranks
    _batches: Optional[Tuple[int, List[_Batch]]] = field(default=None, init=False, repr=False, compare=False)

    def update(self, table: Union[torch.Tensor, Sequence[Sequence[float]]], step: int) -> List[int]:
        """Feed one step's table (rows: ranks; columns: :data:`FIELDS`); the ranks newly
        flagged at this step, in the order of :attr:`groups` and their ranks. Tensor work
        over the groups of one size at once (a job of thousands of ranks runs this every
        step), the same decisions and figures as a rank-by-rank loop."""
        if self.score <= 0:
            return []
        t = as_table(table)
        hits = []
        for batch in self._batched(len(t)):
            own = _self_times(batch.times(t))
            median = others_medians(own)
            s = torch.where(own > 0, median / own, 1.0)
            slow = (s < self.score) & (own - median >= self.min_s)
            batch.streak = streak = torch.where(slow, batch.streak + 1, 0)
            for g, i in (streak >= self.steps).nonzero().tolist():
                if batch.ranks[g][i] not in self.flagged:
                    hits.append((batch.positions[g], i, batch.ranks[g][i], float(s[g, i]), float(own[g, i]),
                                 float(median[g, i]), int(streak[g, i])))
        for _, _, rank, s, own, median, streak in sorted(hits):
            self.flagged[rank] = {"rank": rank, "step": step, "score": round(s, 3), "self_s": own,
                                  "median_self_s": median, "steps_in_a_row": streak}
        return [hit[2] for hit in sorted(hits)]

    def streaks(self) -> Dict[int, int]:
        """Per rank of a group of two or more, the steps in a row it was slow."""
        return {rank: n for batch in (self._batches or (0, []))[1]
                for ranks, counts in zip(batch.ranks, batch.streak.tolist()) for rank, n in zip(ranks, counts)}

    def _batched(self, world: int) -> List[_Batch]:
        """The groups of two ranks or more, by size; made once for a world size."""
        if self._batches is None or self._batches[0] != world:
            groups = self.groups or [list(range(world))]
            ranks = [r for g in groups for r in g]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"Stragglers.groups must be disjoint: a rank is in two groups of {groups}")
            sizes: Dict[int, List[int]] = {}
            for i, g in enumerate(groups):
                if len(g) >= 2:
                    sizes.setdefault(len(g), []).append(i)
            batches = []
            for positions in sizes.values():
                members = [groups[i] for i in positions]
                flat = [r for g in members for r in g]
                rows = None if flat == list(range(world)) else torch.tensor(flat)
                batches.append(_Batch(positions, members, rows, torch.zeros(len(members), len(members[0]),
                                                                            dtype=torch.int64)))
            self._batches = (world, batches)
        return self._batches[1]


def others_medians(values: torch.Tensor) -> torch.Tensor:
    """For each value of each row, the median of the row's others: the row's order
    statistics around its middle, picked by comparison (two or three quickselects a row,
    no sort and no loop over values). With the row's values ranked r[0] <= r[1] <= ..., the k-th smallest of the
    others of v is r[k] where v > r[k], else r[k + 1] (where v == r[k], either of its copies
    left out leaves the same others); the median of n = size - 1 others is the middle one
    for odd n, the two middle ones added and halved for even n, as ``statistics.median``."""
    n = values.shape[-1] - 1
    m = n // 2
    ranked = {j: values.kthvalue(j + 1, dim=-1, keepdim=True).values for j in range(m - 1 + n % 2, m + 2)}

    def kth(k: int) -> torch.Tensor:  # the k-th smallest (from 0) of the others, for each value
        return torch.where(values > ranked[k], ranked[k], ranked[k + 1])

    return kth(m) if n % 2 else (kth(m - 1) + kth(m)) / 2


def medians_of_the_others(values: Sequence[float]) -> List[float]:
    """:func:`others_medians` of a list."""
    return others_medians(torch.as_tensor(values, dtype=torch.float64)).tolist()


def peers(layout) -> List[List[int]]:
    """Ranks that do the same work each step (spec.layout.Layout): the same pipeline stage
    and tensor-parallel rank, across the data-parallel ranks."""
    groups: Dict[tuple, List[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        groups.setdefault((c.get("pp", 0), c.get("tp", 0)), []).append(rank)
    return list(groups.values())
