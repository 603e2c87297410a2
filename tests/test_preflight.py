"""Preflight: per-rank compute and all-reduce numbers, outlier nodes, preflight.json, exclusion."""
from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from conftest import launcher, run_dir_of
from launcher.local import free_port
from launcher.track.resume import exclude_failed_nodes
from spec.config import RunConfig
from train.harness.preflight import PREFLIGHT_JSON, find_outliers
from spec.rundir import read_run_json


def row(rank, host, gflops, gbps=10.0):
    return {"rank": rank, "host": host, "gflops": gflops, "allreduce_gbps": gbps}


def test_slow_node_is_an_outlier_and_its_weakest_rank_counts():
    ranks = [row(0, "a", 100), row(1, "a", 98), row(2, "b", 101), row(3, "b", 40),  # one bad GPU on b
             row(4, "c", 99), row(5, "c", 100)]
    result = find_outliers(ranks, 0.7)
    nodes = {n["host"]: n for n in result["nodes"]}
    assert nodes["b"]["gflops"] == 40 and nodes["b"]["ranks"] == [2, 3]  # a node is as fast as its slowest rank
    assert result["median_of_nodes"]["gflops"] == 98
    assert [o["host"] for o in result["outliers"]] == ["b"]
    assert result["outliers"][0]["reasons"] == ["gflops 40 < 0.7 x median 98"]
    assert [o["rank"] for o in result["rank_outliers"]] == [3]


def test_bandwidth_outlier_and_no_outliers():
    slow_link = [row(0, "a", 100, 20.0), row(1, "b", 100, 21.0), row(2, "c", 100, 5.0)]
    result = find_outliers(slow_link, 0.7)
    assert [o["host"] for o in result["outliers"]] == ["c"]
    assert result["outliers"][0]["reasons"][0].startswith("allreduce_gbps 5 <")
    even = [row(0, "a", 100), row(1, "b", 90)]
    assert find_outliers(even, 0.7)["outliers"] == [] and find_outliers(even, 0.7)["rank_outliers"] == []


def test_a_world_of_one_has_no_bandwidth_and_no_outliers():
    result = find_outliers([row(0, "a", 50, None)], 0.7)
    assert result["nodes"] == [{"host": "a", "ranks": [0], "gflops": 50, "allreduce_gbps": None}]
    assert result["median_of_nodes"]["allreduce_gbps"] is None and result["outliers"] == []


def _rank(rank: int, world: int, port: int, out: str, slow_rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from pathlib import Path

    from train.harness import preflight
    from train.harness.dist import init_distributed

    if rank == slow_rank:  # a node whose compute is 1% of the others'
        measure = preflight.measure

        def slow(*args, **kwargs):
            numbers = measure(*args, **kwargs)
            return {**numbers, "gflops": numbers["gflops"] / 100}
        preflight.measure = slow
    ctx = dataclasses.replace(init_distributed(120), hostname=f"node{rank + 1}")  # one node per rank
    try:
        preflight.run_preflight(ctx, Path(out), 0.7, exclude=True, log=print)
        outcome = "trained"
    except preflight.PreflightError as exc:
        outcome = str(exc)
    Path(out, f"outcome{rank}").write_text(outcome)


def _spawn(tmp_path, slow_rank: int, world: int = 2) -> list:
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(world, port, str(tmp_path), slow_rank), nprocs=world, start_method="spawn")
    return [(tmp_path / f"outcome{r}").read_text() for r in range(world)]


@pytest.mark.slow
def test_two_gloo_ranks_report_and_an_outlier_node_is_excluded_on_resume(tmp_path):
    outcomes = _spawn(tmp_path, slow_rank=1)
    assert all("preflight marked outlier nodes node2" in o for o in outcomes), outcomes  # every rank stops
    report = json.loads((tmp_path / PREFLIGHT_JSON).read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and report["exclude"] is True
    assert all(r["gflops"] > 0 and r["allreduce_gbps"] > 0 for r in report["ranks"])
    assert [o["host"] for o in report["outliers"]] == ["node2"]
    # no nvidia-smi here: each node's GPU health check skips, and is no reason to fail it
    assert report["gpu_health"] == {h: {"skipped": "no nvidia-smi on this node"} for h in ("node1", "node2")}
    info = read_run_json(tmp_path)
    assert info["status"] == "failed" and info["failure"] == "preflight_outlier"
    assert info["suspect_nodes"] == ["node2"]
    cfg = RunConfig()
    cfg.cluster.backend, cfg.cluster.exclude = "slurm", "node7"
    exclude_failed_nodes(cfg, tmp_path)  # what `python -m launcher.resume RUN_DIR` does first
    assert cfg.cluster.exclude == "node2,node7" and read_run_json(tmp_path)["excluded_nodes"] == ["node2", "node7"]


@pytest.mark.slow
def test_launcher_run_writes_preflight_json_and_trains(tmp_path):
    proc = launcher(["train.preflight=true", "train.steps=2", "train.seq_len=32", "data.num_tokens=20000",
                     "cluster.gpus_per_node=2", f"data.cache_dir={tmp_path}/data"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preflight: 1 node(s)" in proc.stdout
    run_dir = run_dir_of(proc.stdout)
    report = json.loads((run_dir / PREFLIGHT_JSON).read_text())
    assert [(r["rank"], r["local_rank"]) for r in report["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["gflops"] > 0 and r["allreduce_gbps"] > 0 for r in report["ranks"])
    assert report["threshold"] == 0.7 and len(report["nodes"]) == 1 and report["outliers"] == []
    assert read_run_json(run_dir)["status"] == "completed"
    facts = json.loads((run_dir / "nodes" / f"{socket.gethostname()}.json").read_text())  # local rank 0 only
    assert facts["torch"] and facts["cpu_count"] == os.cpu_count() and facts["cuda"] is None
    assert [p.name for p in (run_dir / "nodes").iterdir()] == [f"{socket.gethostname()}.json"]
