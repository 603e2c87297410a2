"""A step's bookkeeping over the gathered times table (train/steptimes.py ``breakdown`` and
``Stragglers.update``, train/loop.py ``Agreed.times``) as tensor operations: the same
figures and decisions, bit for bit, as the rank-by-rank Python it replaced (kept below as
the reference) on random tables with ties, zeros and self times <= 0, and at 4,096 ranks
the same number of Python calls as at 64 (nothing a rank)."""
from __future__ import annotations

import random
import statistics
import sys
from typing import Dict, List

import pytest
import torch

from train.loop import StepTable, _agree
from train.steptimes import FIELDS, StepClock, Stragglers, breakdown, medians_of_the_others, self_times, spread

from conftest import FAKE_WORLD as WORLD  # noqa: E402


# ---- the reference: the code before the tensors, as it was -------------------------------------

def old_spread(values):
    worst = max(range(len(values)), key=lambda r: values[r])
    return {"min": float(min(values)), "median": float(statistics.median(values)), "max": float(values[worst]),
            "max_rank": worst}


def old_breakdown(table):
    columns = {name: [float(row[i]) for row in table] for i, name in enumerate(FIELDS)}
    slowest = max(columns["busy_s"])
    out = {name: old_spread(values) for name, values in columns.items()}
    out["wait_s"] = old_spread([slowest - b for b in columns["busy_s"]])
    return out


def old_self_times(table, group):
    i_fb, i_busy = FIELDS.index("fwd_bwd_s"), FIELDS.index("busy_s")
    least_fb = min(float(table[r][i_fb]) for r in group)
    return {r: float(table[r][i_busy]) - (float(table[r][i_fb]) - least_fb) for r in group}


def old_medians_of_the_others(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranked = [values[i] for i in order]
    n, out = len(values) - 1, [0.0] * len(values)

    def kth(k, gone):
        return ranked[k] if k < gone else ranked[k + 1]

    for position, i in enumerate(order):
        m = n // 2
        out[i] = kth(m, position) if n % 2 else (kth(m - 1, position) + kth(m, position)) / 2
    return out


class OldStragglers:
    def __init__(self, score=0.67, steps=10, min_s=0.05, groups=None):
        self.score, self.steps, self.min_s, self.groups = score, steps, min_s, groups or []
        self.streak: Dict[int, int] = {}
        self.flagged: Dict[int, dict] = {}

    def update(self, table, step):
        if self.score <= 0:
            return []
        new = []
        for group in self.groups or [list(range(len(table)))]:
            if len(group) < 2:
                continue
            own = old_self_times(table, group)
            others = old_medians_of_the_others([own[r] for r in group])
            for rank, median in zip(group, others):
                s = median / own[rank] if own[rank] > 0 else 1.0
                slow = s < self.score and own[rank] - median >= self.min_s
                self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
                if self.streak[rank] >= self.steps and rank not in self.flagged:
                    self.flagged[rank] = {"rank": rank, "step": step, "score": round(s, 3), "self_s": own[rank],
                                          "median_self_s": median, "steps_in_a_row": self.streak[rank]}
                    new.append(rank)
        return new


# ---- random tables ---------------------------------------------------------------------------

def random_table(rng: random.Random, world: int, slow=(), coarse: bool = False) -> List[List[float]]:
    """Rows of FIELDS: busy ~0.1 s; ``coarse``: rounded to ms (many ties); ``slow``: ranks
    0.1 s busier; some zeros and a rank whose fwd_bwd exceeds its busy (self time <= 0)."""
    def value(x: float) -> float:
        return round(x, 3) if coarse else x

    rows = []
    for r in range(world):
        busy = value(0.1 + rng.gauss(0, 0.01)) + (0.1 if r in slow else 0.0)
        fwd_bwd = value(rng.choice([0.08, 0.08 + rng.random() * 0.02, busy]))
        rows.append([value(rng.choice([0.0, rng.random() * 0.005])), fwd_bwd, value(rng.random() * 0.01),
                     busy if rng.random() > 0.02 else 0.0])
    return rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 33, 512, WORLD])
@pytest.mark.parametrize("coarse", [False, True])
def test_breakdown_gives_the_figures_of_the_lists(world, coarse):
    rng = random.Random(world * 2 + coarse)
    for _ in range(3):
        rows = random_table(rng, world, coarse=coarse)
        want = old_breakdown(rows)
        for table in (rows, torch.tensor(rows, dtype=torch.float64)):
            got = breakdown(table)
            assert got == want  # exact: no approx
            assert all(type(v) is type(want[f][k]) for f in got for k, v in got[f].items())


def test_ties_name_the_first_rank_of_the_max():
    assert spread([0.1, 0.3, 0.2, 0.3, 0.3]) == old_spread([0.1, 0.3, 0.2, 0.3, 0.3]) == \
        {"min": 0.1, "median": 0.3, "max": 0.3, "max_rank": 1}
    assert breakdown([[0.0, 0.1, 0.0, 0.2]] * 6)["busy_s"]["max_rank"] == 0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 33, 64, 65])
def test_the_medians_of_the_others_are_the_lists(n):
    rng = random.Random(n)
    for values in ([rng.random() for _ in range(n)], [rng.choice([0.1, 0.2, 0.3]) for _ in range(n)],
                   [0.0] * n):
        assert medians_of_the_others(values) == old_medians_of_the_others(values)


GROUPS = {
    "data parallel": lambda w: [],
    "peers of 4": lambda w: [list(range(i, w, w // 4)) for i in range(w // 4)],
    "sizes 1, 2, 3 and the rest": lambda w: [[0], [1, 2], [3, 4, 5], list(range(6, w))],
}


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("world, coarse", [(8, True), (16, False), (37, True), (512, False)])
def test_stragglers_decide_as_the_lists_did(groups, world, coarse):
    """Slow ranks come and go (streaks broken and resumed): every step's new ranks, the
    flagged records and every rank's streak are the reference's."""
    rng = random.Random(world)
    made = GROUPS[groups](world)
    old, new = OldStragglers(steps=3, min_s=0.05, groups=made), Stragglers(steps=3, min_s=0.05, groups=made)
    for step in range(1, 31):
        slow = {r for r in range(world) if (r * 7 + step // 5) % 5 == 0 and rng.random() > 0.1}
        rows = random_table(rng, world, slow=slow, coarse=coarse)
        table = torch.tensor(rows, dtype=torch.float64) if step % 2 else rows
        assert new.update(table, step) == old.update(rows, step), step
        assert new.flagged == old.flagged and list(new.flagged) == list(old.flagged)
        assert new.streaks() == old.streak
    assert old.flagged, "the replay flags someone"


def test_self_times_of_a_group_are_the_lists():
    rows = random_table(random.Random(1), 16, coarse=True)
    assert self_times(rows, [3, 1, 7, 8]) == old_self_times(rows, [3, 1, 7, 8])


def test_groups_that_share_a_rank_are_refused():
    with pytest.raises(ValueError, match="disjoint"):
        Stragglers(groups=[[0, 1], [1, 2]]).update([[0.0, 0.1, 0.0, 0.1]] * 3, 1)


def _python_calls(fn) -> int:
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(event) if event in ("call", "c_call") else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_at_4096_ranks_no_python_work_a_rank():
    """The step's bookkeeping makes as many Python calls at 4,096 ranks as at 64."""
    counts = []
    for world in (64, WORLD):
        table = torch.tensor(random_table(random.Random(0), world), dtype=torch.float64)
        detector = Stragglers(groups=[list(range(world))])
        detector.update(table, 1)  # the groups' index, made once
        counts.append(_python_calls(lambda: (breakdown(table), detector.update(table, 2))))
    assert counts[0] == counts[1], counts


def test_the_agreed_times_are_the_tables_as_a_tensor_kept_from_the_refill(fake_world):
    from test_agreement_scale import _engine, _task

    table, clock = StepTable(WORLD), StepClock(torch.device("cpu"))
    agreed = _agree(_task(WORLD), _engine(1), 0, torch.tensor(2.0), torch.tensor(1.0), False, clock, gathered=table)
    times = agreed.times
    assert times.shape == (WORLD, len(FIELDS)) and times.dtype == torch.float64
    assert times.tolist() == table.buffer[:, 7:].tolist()  # what the loop's lists held
    assert times.data_ptr() != table.buffer.data_ptr()
