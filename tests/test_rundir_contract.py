"""The run directory's contract (spec/rundir.py): run.json's statuses, metrics.jsonl's rows.

These names are read outside the project (dashboards, users' scripts): the file format
must not move when the code does."""
from __future__ import annotations

import ast
import json
from pathlib import Path

from conftest import REPO
from spec.rundir import METRICS, MetricsRow, Status, append_metrics, read_metrics, read_run_json, status_of, \
    steady, update_run_json

ROW = {"step": 3, "loss": 5.5, "lr": 1e-3, "grad_norm": 0.7, "step_time_s": 0.25, "tokens_per_s": 1024.0,
       "samples_per_s": 8.0, "peak_mem_bytes": 2**30, "mfu": None, "global_batch_size": 2, "tokens_per_step": 256,
       "world_size": 2, "segment": 0, "time": 1.5}


def test_a_trainer_row_is_written_as_it_always_was(tmp_path):
    append_metrics(tmp_path, MetricsRow(**ROW))
    line = (tmp_path / METRICS).read_text().strip()
    assert json.loads(line) == ROW and list(json.loads(line)) == list(ROW)  # same keys, same order
    assert '"mfu": null' in line  # no peak FLOP/s: null, not absent
    row = read_metrics(tmp_path)[0]  # read back, it is the record (a Mapping) it was written as
    assert dict(row) == ROW and set(row) == set(ROW) and "mfu" in row and row["loss"] == 5.5 and len(row) == len(ROW)


def test_unknown_fields_are_kept_and_unset_ones_are_not_written(tmp_path):
    append_metrics(tmp_path, MetricsRow.from_dict({"step": 1, "loss": 2.0, "bleu": 7.5}))
    written = json.loads((tmp_path / METRICS).read_text())
    assert written == {"step": 1, "loss": 2.0, "mfu": None, "bleu": 7.5}
    row = read_metrics(tmp_path)[0]
    assert row.loss == 2.0 and row["bleu"] == 7.5 and row.get("tokens_per_s") is None and row.extra == {
        "bleu": 7.5}


def test_torn_and_stepless_lines_are_skipped(tmp_path):
    (tmp_path / METRICS).write_text(json.dumps(ROW) + "\n" + '{"note": "no step"}\n' + '{"step": 4, "lo')
    rows = read_metrics(tmp_path)
    assert [r.step for r in rows] == [3]


def test_status_is_the_plain_string_in_run_json(tmp_path):
    update_run_json(tmp_path, status=Status.REQUEUED)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "requeued"
    assert status_of(read_run_json(tmp_path)) is Status.REQUEUED
    assert status_of({"status": "something old"}) is None and status_of({}) is None
    assert {s for s in Status if s.final} == {Status.COMPLETED, Status.STOPPED}
    assert Status.FAILED.ended and not Status.REQUEUED.ended


def test_steady_state_is_one_definition():
    assert steady([1]) == [1]
    assert steady([1, 2]) == [2]  # at least the first step goes
    assert steady(list(range(8))) == list(range(2, 8))  # the first quarter goes


def _status_values(path: Path):
    """Every ``status=...`` keyword and every ``"status": ...`` dict entry of a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "status":
            yield node.value
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "status":
                    yield value


def test_every_status_written_is_a_status_member():
    """A status spelled as a string literal anywhere in the code is a status the enum may
    not know: each must be ``Status.X``."""
    bad = []
    for room in ("launcher", "train", "spec", "slurm"):
        for path in (REPO / room).rglob("*.py"):
            for value in _status_values(path):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    bad.append(f"{path.relative_to(REPO)}:{value.lineno} status={value.value!r}")
    assert not bad, "use spec.rundir.Status:\n" + "\n".join(bad)
