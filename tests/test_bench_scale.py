"""bench/scale.py at W = 8 and 512 with a few steps, in this process: its table has every
column, and a restore and a failure's classification cost at most 8 file calls a rank (plus,
at W = 8, a few for rank 0's listing and surveys: 67 calls for the restore)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ("W", "step host CPU ms (rank 0 / last)", "file calls a step (rank 0 / last)",
           "async coordination ms (rank 0 / last)", "restore file calls a job (per rank)", "restore s",
           "classification file calls a job (per rank)", "classification s")


def test_the_table_at_8_and_512_ranks(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.scale import measure, render

    rows = [measure(world, 3, tmp_path) for world in (8, 512)]
    text = render(rows)
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert header == list(COLUMNS), header
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 3  # header + 2 rows
    for row in rows:
        world = row["world"]
        assert set(row["steps"]) == {0, world - 1}
        assert row["steps"][0]["calls"] == 3 and row["steps"][world - 1]["calls"] == 2  # beat (2), row (rank 0)
        assert all(v is not None and v >= 0 for v in row["coordination"].values())
        for job in ("restore", "classify"):
            calls, seconds = row[job]
            assert 0 < calls <= 8 * world + (16 if world < 64 else 0), (job, world, calls)
    assert "Goal: file calls a job linear in W" in text
