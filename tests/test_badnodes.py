"""Bad-node handling without a cluster: hardware-fault patterns, unhealthy GPUs among the
preflight's outliers (nvidia-smi parsing: tests/test_health.py), per-node facts, and the
automatic requeue's decisions and its request to the batch script (what the batch script
does with it: tests/test_slurm_request.py). The end-to-end test with a killed node is in
tests/test_node_failure.py."""
from __future__ import annotations

import json
import os
import socket

import pytest

from slurm.request import read_request
from spec.rundir import SLURM_JOB, SLURM_REQUEST, read_run_json, update_run_json
from train.harness import badnodes, health
from train.harness.outcome import outranks, record_failure
from train.harness.preflight import add_unhealthy

# nvidia-smi's outputs and the kernel log's Xids in every form they take: tests/test_health.py.


@pytest.mark.parametrize("text,kind,local", [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be ...",
     "gpu_ecc", True),
    ("[9001.0] NVRM: Xid (PCI:0000:2a:00): 79, pid=1, GPU has fallen off the bus.", "gpu_xid", True),
    ("node3:123:456 [0] NCCL INFO ...\ntorch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970,"
     " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5", "nccl_system", True),
    ("node3:1:2 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.4<53622> with error 12, opcode 0",
     "nccl_system", True),
    ("DistBackendError: NCCL error: remote process exited or there was a network error, NCCL version 2.21.5",
     "nccl_remote", False),
    ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO"
     " for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or external library call"
     " failed or device error.\nLast error:\nsocket recv: Connection closed by remote peer node2<4567>",
     "nccl_remote", False),  # a survivor's view of a dead peer: not this node's fault
    ("NCCL WARN Connection closed by remote peer\n[1.0] NVRM: Xid (PCI:0000:18:00): 48, DBE", "gpu_xid", True),
], ids=["cuda_ecc", "kernel_xid", "nccl_system_error", "nccl_ib_completion", "nccl_remote_exited",
        "survivor_of_a_dead_peer", "xid_beats_a_remote_peer"])
def test_hardware_fault_names_the_fault_and_whose_it_is(text, kind, local):
    fault = health.hardware_fault(text)
    assert fault is not None and (fault["kind"], fault["local"]) == (kind, local)
    assert fault["line"] in text


@pytest.mark.parametrize("text", [
    "RuntimeError: Connection closed by peer [127.0.0.1]:29500",  # gloo: a peer died, no hardware named
    "ValueError: fault.raise_at_step=3 reached",
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "",
], ids=["gloo_peer_closed", "raise_at_step", "cuda_oom", "empty"])
def test_no_hardware_fault_in_ordinary_errors(text):
    assert health.hardware_fault(text) is None


def test_unhealthy_nodes_join_the_preflight_outliers():
    result = {"outliers": [{"host": "n1", "reasons": ["gflops 1 < 0.7 x median 3"]}], "nodes": []}
    health_by_node = {"n1": {"unhealthy": ["GPU 0: 1 uncorrected ECC errors"]}, "n2": {"skipped": "no nvidia-smi"},
                      "n3": {"unhealthy": ["GPU 3: row remapping failed"]}, "n4": {"unhealthy": []}}
    out = add_unhealthy(result, health_by_node)
    assert out["outliers"] == [{"host": "n1", "reasons": ["gflops 1 < 0.7 x median 3", "GPU 0: 1 uncorrected ECC errors"]},
                               {"host": "n3", "reasons": ["GPU 3: row remapping failed"]}]


def test_node_facts_on_a_cpu_node(tmp_path):
    from train.harness.node_facts import write_node_facts

    path = write_node_facts(tmp_path, "nodeX")
    facts = json.loads(path.read_text())
    assert path == tmp_path / "nodes" / "nodeX.json"
    assert facts["host"] == "nodeX" and facts["cpu_count"] == os.cpu_count() and facts["torch"]
    assert facts["cuda"] is None and facts["nccl"] is None and facts["driver"] is None and facts["gpu_count"] == 0


def test_plan_exclusion_and_the_nodes_left():
    info = {"failure": "node_failure", "suspect_nodes": ["n2"], "excluded_nodes": ["n7"], "requeues_since_submit": 1}
    plan = badnodes.plan_exclusion(info, "n[4-5]", max_requeues=3)
    assert plan["excluded"] == ["n2", "n4", "n5", "n7"] and plan["nodes"] == ["n2"] and not plan["capped"]
    assert badnodes.plan_exclusion(dict(info, requeues_since_submit=3), None, 3)["capped"]
    assert badnodes.plan_exclusion(dict(info, failure="rank_failure"), None, 3) is None
    assert badnodes.plan_exclusion(dict(info, suspect_nodes=[]), None, 3) is None
    usable = {"n1": "pair1", "n2": "pair1", "n3": "pair2", "n4": "pair2,big"}
    assert badnodes.nodes_left(2, usable, ["n2"]) == ["n1", "n3", "n4"]
    assert badnodes.nodes_left(2, usable, ["n2"], "pair1") == ["n1"]
    assert badnodes.nodes_left(2, usable, ["n2"], "pair1|pair2") == ["n1", "n3", "n4"]  # not parsed: not filtered


def job_facts(run_dir, nodes="node1|alloc|pair1\nnode2|alloc*|pair1\nnode3|idle|pair2\nnode4|down*|pair2\n"):
    """RUN_DIR/slurm_job.txt as the batch script writes it at the segment's start."""
    (run_dir / SLURM_JOB).write_text("JobId=7 JobName=x Partition=debug NumNodes=2 Features=(null) "
                                     "EndTime=1795694547 ExcNodeList=(null)\n" + nodes)


def run_dir_with(tmp_path, max_requeues=3, **info):
    from spec.config import RunConfig, to_yaml

    cfg = RunConfig()
    cfg.cluster.backend, cfg.cluster.max_requeues = "slurm", max_requeues
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    update_run_json(tmp_path, status="failed", segments=1, **info)
    return tmp_path


def test_one_rank_asks_the_batch_script_to_requeue_without_the_dead_node(tmp_path, monkeypatch):
    from spec.config import to_run_config

    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run_dir = run_dir_with(tmp_path, failure="node_failure", suspect_nodes=["node2.cluster"], error="RuntimeError: peer")
    job_facts(run_dir)
    (run_dir / "nodes").mkdir()  # the ranks saw a qualified hostname; Slurm calls the node node2
    (run_dir / "nodes" / "node2.cluster.json").write_text(json.dumps({"slurm_node": "node2"}))
    said = []
    assert badnodes.requeue_without_suspects(run_dir, said.append, "7") == badnodes.REQUEUED
    assert badnodes.requeue_without_suspects(run_dir, said.append, "7") == badnodes.ELSEWHERE  # claimed once
    info = read_run_json(run_dir)
    assert info["status"] == "requeued" and info["excluded_nodes"] == ["node2"] and info["fault_requeues"] == 1
    assert info["requeues_since_submit"] == 1 and info["last_interruption"] == "node_failure"
    [entry] = info["node_exclusions"]
    assert entry["nodes"] == ["node2"] and entry["reason"] == "node failure" and entry["job_id"] == "7"
    assert to_run_config(run_dir / "config.yaml").cluster.exclude == "node2"
    # the batch script does the hold-requeue, ExcNodeList and release (tests/test_slurm_request.py)
    assert read_request(run_dir / SLURM_REQUEST) == {"action": "exclude", "exclude": "node2",
                                                      "reason": "node failure on node2"}
    assert "requeueing job 7 without node2" in said[0]


def test_no_requeue_at_the_cap_or_without_enough_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    capped = run_dir_with(tmp_path / "a", max_requeues=2, failure="node_failure", suspect_nodes=["node2"],
                          requeues_since_submit=2)
    why = badnodes.requeue_without_suspects(capped, lambda s: None, "7")
    assert "cluster.max_requeues=2 reached" in why and read_run_json(capped)["status"] == "failed"
    assert "not requeued" in read_run_json(capped)["auto_requeue"]
    # node4 is down: without node2 and node3 only node1 is left for a 2-node job
    short = run_dir_with(tmp_path / "b", failure="hardware_fault", suspect_nodes=["node2", "node3"])
    job_facts(short)
    why = badnodes.requeue_without_suspects(short, lambda s: None, "7")
    assert why.startswith("only 1 usable node(s) of partition debug") and read_run_json(short)["status"] == "failed"
    assert not (capped / SLURM_REQUEST).exists() and not (short / SLURM_REQUEST).exists()
    # the job's feature counts: pair1 has node1 left only, and without the file nothing says
    assert badnodes.shortfall(short, ["node3"]) is None
    job_facts(short, "node1|idle|pair1\nnode2|idle|pair1\nnode3|idle|pair2\n")
    (short / SLURM_JOB).write_text((short / SLURM_JOB).read_text().replace("Features=(null)", "Features=pair1"))
    assert badnodes.shortfall(short, ["node2"]).startswith("only 1 usable node(s)")
    (short / SLURM_JOB).unlink()
    assert badnodes.shortfall(short, ["node1", "node2", "node3"]) is None


def test_a_crash_naming_this_nodes_gpu_blames_this_node(tmp_path, monkeypatch):
    import logging

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    log = logging.getLogger("test_badnodes")
    record_failure(RuntimeError("CUDA error: uncorrectable ECC error encountered"), tmp_path, 3, 4, log, 0)
    info = read_run_json(tmp_path)
    assert info["failure"] == "hardware_fault" and info["suspect_nodes"] == [socket.gethostname()]
    assert info["fault"]["kind"] == "gpu_ecc"
    # a peer's broken connection after it does not replace the cause
    record_failure(RuntimeError("Connection closed by peer"), tmp_path, 0, 4, log, 0)
    assert read_run_json(tmp_path)["failure"] == "hardware_fault"
    assert outranks("hang", "node_failure") and not outranks("rank_failure", "hardware_fault")


def test_status_shows_each_nodes_facts_and_the_exclusions(tmp_path):
    from launcher.track.status import node_lines

    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "node1.json").write_text(json.dumps(
        {"host": "node1", "torch": "2.13.0+cpu", "cuda": None, "cudnn": None, "nccl": None, "driver": None,
         "gpu_count": 0, "gpu_model": None, "cpu_count": 4}))
    (tmp_path / "nodes" / "gpu7.json").write_text(json.dumps(
        {"host": "gpu7", "torch": "2.6.0", "cuda": "12.4", "cudnn": 90100, "nccl": "2.21.5", "driver": "550.54.15",
         "gpu_count": 8, "gpu_model": "NVIDIA H100 80GB HBM3", "cpu_count": 192}))
    update_run_json(tmp_path, node_exclusions=[{"nodes": ["node2"], "reason": "node failure", "job_id": "7",
                                                "segment": 1}])
    assert node_lines(tmp_path) == [
        "node gpu7: torch 2.6.0, CUDA 12.4, cuDNN 90100, NCCL 2.21.5, driver 550.54.15, 8 x NVIDIA H100 80GB HBM3, "
        "192 CPUs",
        "node node1: torch 2.13.0+cpu, CUDA -, cuDNN -, NCCL -, driver -, no GPU, 4 CPUs",
        "excluded node2 after node failure (job 7, segment 1): requeued without it"]


def test_a_fault_is_looked_for_in_this_segments_stderr_only(tmp_path, monkeypatch):
    from train.harness import outcome

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "90_1_log.err").write_text("NCCL error: unhandled system error\n")  # another job's
    err = tmp_path / "slurm" / "9_1_log.err"
    err.write_text("[1.0] NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus\n")  # an earlier segment's
    outcome.mark_stderr(tmp_path)
    assert outcome.hardware_fields("ValueError: x", tmp_path, {}) == {}
    with open(err, "a") as f:
        f.write("node1:1:2 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.4<1> with error 12, opcode 0\n")
    fields = outcome.hardware_fields("RuntimeError: NCCL communicator was aborted", tmp_path, {})
    assert fields["failure"] == "hardware_fault" and fields["fault"]["kind"] == "nccl_system"
    assert fields["suspect_nodes"] == [socket.gethostname()]
    assert outcome.hardware_fields("ValueError: x", tmp_path, {"dead_ranks": [3]}) == {}  # a peer died: its echo


def test_a_late_rank_does_not_undo_the_requeue(tmp_path, monkeypatch):
    import logging

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    update_run_json(tmp_path, status="requeued", failure="node_failure", suspect_nodes=["node2"])
    record_failure(RuntimeError("CUDA error: uncorrectable ECC error encountered"), tmp_path, 1, 4,
                   logging.getLogger("test_badnodes"), 0)
    assert read_run_json(tmp_path)["status"] == "requeued"
