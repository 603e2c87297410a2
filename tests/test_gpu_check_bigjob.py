"""The ``bigjob/*`` rows of `make gpu-check` (bench/gpu_check_bigjob.py, bench/bigjob_rank.py)
on CPU: rank 0 of the 512-rank llama3_70b fsdp_tp job's shards by theory (the shapes the
trainer's build gave on the meta model here), its ``--dry`` run end to end (every
section's verdict and figures), the memory verdict against the planner, and the rows
that wait for the rank's result (a rank that failed or never started is said so)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))

from bench import bigjob_rank as br  # noqa: E402
from bench import gpu_check_bigjob as gb  # noqa: E402
from bench.bigjob_parts import GIB, expected_local, memory_line  # noqa: E402

# Rank 0's shards of llama3_70b at dp_shard 256 x tp 2, as train/parallelize.py built them
# (on the fake process group, materialised on CPU; the row checks every one on the GPU).
SHARDS_70B = {
    "tok_embeddings.weight": ((128256, 8192), (251, 8192)),
    "layers.0.attention_norm.weight": ((8192,), (32,)),
    "layers.0.attention.wq.weight": ((8192, 8192), (16, 8192)),
    "layers.0.attention.wk.weight": ((1024, 8192), (2, 8192)),
    "layers.0.attention.wo.weight": ((8192, 8192), (32, 4096)),
    "layers.0.feed_forward.w1.weight": ((28672, 8192), (56, 8192)),
    "layers.0.feed_forward.w2.weight": ((8192, 28672), (32, 14336)),
    "norm.weight": ((8192,), (32,)),
    "output.weight": ((128256, 8192), (251, 8192)),
}


@pytest.mark.parametrize("name", sorted(SHARDS_70B))
def test_rank_zero_shards_by_theory(name):
    whole, local = SHARDS_70B[name]
    assert expected_local(name, whole, tp=2, dp=256) == local


def test_the_memory_verdict_against_the_planner():
    plan = {"total_bytes": 40 * GIB, "overhead_bytes": 3 * GIB}
    mem = {"allocated": 34 * GIB, "reserved": 37 * GIB, "beside": 0.6 * GIB, "device": 37.6 * GIB}
    line, ratio = memory_line(mem, plan)
    assert ratio == pytest.approx(0.94) and line.startswith("device/planned 0.94 (within the 10% goal): peak 34.0 GiB")
    assert "planned 40.0 GiB (37.0 without its CUDA overhead: allocated/that 0.92)" in line
    line, ratio = memory_line({**mem, "device": 48 * GIB}, plan)
    assert ratio == pytest.approx(1.2) and "outside the 10% goal" in line
    assert memory_line({"allocated": 1, "reserved": 0}, plan) == ("memory not compared on CPU (planned 40.00 GiB a GPU)",
                                                                 None)


def test_rows_share_one_rank_and_each_call_its_own_directory(tmp_path, monkeypatch):
    from bench.gpu_check import select

    first = gb.rows(tmp_path)
    monkeypatch.setenv("STO_BIGJOB_ARGS", "--layers 20")  # the rank's own options, from make gpu-check
    second = gb.rows(tmp_path)
    assert second[0].argv[-2:] == ["--layers", "20"] and first[0].argv[-1] == str(first[0].run_dir)
    assert [r.name for r in first] == ["bigjob/rank", "bigjob/snapshot", "bigjob/save_load", "bigjob/affinity"]
    assert len({r.run_dir for r in first}) == 1 and first[0].run_dir != second[0].run_dir
    assert first[0].env["CUDA_VISIBLE_DEVICES"] and not any(r.launch for r in first)
    assert [r.name for r in select(first, ["bigjob"])] == [r.name for r in first]


def _script(*args, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "bench/bigjob_rank.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_end_to_end(tmp_path):
    """The rank on CPU (a tiny model's shape, the job's 512-rank layout): every section
    passes, and its figures say what was checked."""
    out = tmp_path / "bigjob"
    proc = _script("rank", str(out), "--dry")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    sections = result["sections"]
    assert {n: s["ok"] for n, s in sections.items()} == {n: True for n in br.SECTIONS}, sections
    rank = sections["rank"]
    assert "rank 0 of 512 (64 x 8; dp_shard 256 x tp 2)" in rank["line"] and "every shard's shape as theory" in rank["line"]
    assert rank["facts"]["shards"]["tok_embeddings.weight"] == [[1024, 256], [2, 256]]
    snap = sections["snapshot"]["facts"]
    assert snap["bytes"] == result["plan"]["state_bytes_per_rank"]  # the planner's bytes of state a rank
    assert snap["pinned_bytes"] == 0  # pinned on a GPU only
    io = sections["save_load"]["facts"]
    assert io["same"] and io["changed_before_load"] and io["flipped"] == "" and io["file_bytes"] > snap["bytes"]
    assert "CPUs 0-3 (NUMA node 0, its GPU's)" in sections["affinity"]["line"]
    assert not (out / "ckpt").exists()  # the state written is removed (a 70B rank's: ~1.7 GB)
    shown = _script("show", "save_load", str(out))
    assert shown.returncode == 0 and "a flipped byte refused" in shown.stdout


def test_a_failed_rank_fails_every_row_with_its_reason(tmp_path):
    out = tmp_path / "bigjob"
    proc = _script("rank", str(out), "--dry", "--micro-batch", "0")
    assert proc.returncode == 1 and "train.micro_batch_size=0 must be >= 1" in proc.stdout
    shown = _script("show", "snapshot", str(out))
    assert shown.returncode == 1 and "snapshot: not reached: RuntimeError: python -m launcher exited 2" in shown.stdout


def test_show_says_when_the_rank_never_ran_or_died(tmp_path):
    result, why = br.wait_result(tmp_path, not_started_s=0.2)
    assert result is None and "bigjob/rank has not started" in why and "--only bigjob" in why
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "started.json").write_text(json.dumps({"pid": int(dead.stdout)}))
    result, why = br.wait_result(tmp_path, not_started_s=0.2)
    assert result is None and "ended without a result" in why
