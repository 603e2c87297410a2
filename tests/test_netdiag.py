"""launcher/netdiag.py: a slow inter-node all-reduce explained from NCCL's ``NCCL_DEBUG=INFO``
network lines (captured runs under tests/fixtures/nccl/), and the doctor's verdict that
carries the advice. Pure: no torch, no GPU."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher import doctor, netdiag
from spec.config import ClusterConfig

FIX = Path(__file__).parent / "fixtures" / "nccl"
EXPECTED = 50.0  # inter_node_gbps of an H100 profile: one 400 Gb/s HCA per GPU


def lines(name: str):
    return (FIX / name).read_text().splitlines()


@pytest.mark.parametrize("fixture, env, variable", [
    ("socket_no_ib.txt", {}, "NCCL_IB_HCA"),
    ("ib_disabled.txt", {}, "NCCL_IB_DISABLE"),  # set by the environment, as NCCL reported it
    ("docker_bridge.txt", {}, "NCCL_SOCKET_IFNAME"),
    ("efa_no_plugin.txt", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}, "NCCL_NET_PLUGIN"),
], ids=["no_ib_device", "ib_disabled", "docker_bridge", "efa_without_plugin"])
def test_a_slow_network_names_the_variable(fixture, env, variable):
    advice = netdiag.diagnose(lines(fixture), 1.2, EXPECTED, env)
    assert advice and any(variable in a for a in advice), advice
    assert all("TCP sockets" in a or "NCCL's sockets" in a for a in advice), advice


def test_what_each_fixture_says():
    f = netdiag.parse(lines("socket_no_ib.txt"))
    assert (f.network, f.sockets, f.ib_none, f.plugin_missing, f.gdr) == ("Socket", ["eth0"], True, True, False)
    assert netdiag.parse(lines("ib_disabled.txt")).env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "ib0"}
    good = netdiag.parse(lines("ib_good.txt"))
    assert good.network == "IB" and good.gdr is True and len(good.ib) == 8 and set(good.ib.values()) == {"IB"}
    assert netdiag.parse(lines("efa_no_plugin.txt")).sockets == ["ens32"]


def test_a_good_infiniband_run_at_full_bandwidth_gives_no_advice():
    assert netdiag.diagnose(lines("ib_good.txt"), 46.0, EXPECTED, {}) == []
    assert netdiag.diagnose(lines("socket_no_ib.txt"), 30.0, EXPECTED, {}) == []  # not far below: no advice
    assert netdiag.diagnose(lines("socket_no_ib.txt"), None, EXPECTED, {}) == []  # one node: nothing measured
    assert netdiag.diagnose(lines("socket_no_ib.txt"), 1.0, None, {}) == []  # no figure in the profile


def test_infiniband_that_is_slow_anyway_points_at_the_fabric():
    advice = netdiag.diagnose(lines("ib_good.txt"), 10.0, EXPECTED, {})
    assert len(advice) == 1 and "ibstat" in advice[0] and "inter_node_gbps" in advice[0]
    scoped = netdiag.diagnose(lines("ib_good.txt"), 10.0, EXPECTED, {"NCCL_IB_HCA": "mlx5_0"})
    assert "NCCL_IB_HCA=mlx5_0" in scoped[0]


@pytest.mark.parametrize("text, env, variable", [
    (["NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.2.0.5<0>",
      "NCCL INFO Using network IB", "NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA"],
     {}, "NCCL_IB_GID_INDEX"),
    (["NCCL INFO Using network IB", "NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'",
      "NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0"], {"NCCL_NET_GDR_LEVEL": "LOC"},
     "NCCL_NET_GDR_LEVEL=LOC"),
    (["NCCL INFO NET/OFI Selected Provider is tcp (found 1 nics)", "NCCL INFO Using network AWS Libfabric"],
     {"FI_EFA_USE_DEVICE_RDMA": "1"}, "FI_PROVIDER=efa"),
    (["NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)",
      "NCCL INFO Using network Libfabric"], {}, "FI_EFA_USE_DEVICE_RDMA=1"),
    (["NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>", "NCCL INFO Using network Socket"], {},
     "GLOO_SOCKET_IFNAME"),
], ids=["roce_gid", "gdr_level", "efa_tcp_provider", "efa_without_device_rdma", "loopback"])
def test_other_causes(text, env, variable):
    advice = netdiag.diagnose(text, 2.0, EXPECTED, env)
    assert any(variable in a for a in advice), advice


def test_no_network_line_says_so():
    advice = netdiag.diagnose(["NCCL version 2.27.7+cuda13.0"], 2.0, EXPECTED, {})
    assert len(advice) == 1 and "NCCL_DEBUG=INFO" in advice[0]


def gpu_rank(rank: int, host: str, **changes):
    """One rank of a 2-GPU node as train/doctor.py reports it (the facts the verdict reads)."""
    facts = {"rank": rank, "local_rank": rank % 2, "node": rank // 2, "host": host, "backend": "nccl",
             "device": f"cuda:{rank % 2}", "accelerator": "gpu", "matmul_tflops": 700.0, "intra_gbps": 380.0,
             "inter_gbps": 45.0}
    return {**facts, **changes}


def report(*ranks):
    return {"world_size": len(ranks), "backend": "nccl", "seconds": 3.0, "ranks": list(ranks)}


def test_the_doctor_verdict_carries_the_advice():
    """A node whose ranks kept socket lines; the report's env and the profile's cluster.env."""
    cluster = ClusterConfig(name="h100x8", backend="slurm", nodes=2, gpus_per_node=2, accelerator="gpu",
                            peak_tflops_bf16=989.0, intra_node_gbps=450, inter_node_gbps=EXPECTED,
                            env={"NCCL_IB_DISABLE": "1"})
    slow = {"inter_gbps": 1.1, "nccl_lines": lines("ib_disabled.txt")[:6], "net_env": {"NCCL_SOCKET_IFNAME": "ib0"}}
    ranks = [gpu_rank(r, "gpu1" if r < 2 else "gpu2", **(slow if r >= 2 else {})) for r in range(4)]
    judged = doctor.verdicts(report(*ranks), cluster)
    assert judged["gpu1"] == {"verdict": "ok", "reasons": []}
    assert judged["gpu2"]["verdict"] == "slow" and any("NCCL_IB_DISABLE=1" in a for a in judged["gpu2"]["network"])
    text = doctor.render(report(*ranks), cluster, judged)
    assert "\n  network: NCCL used TCP sockets (NET/Socket : Using ib0)" in text


def test_the_job_keeps_the_network_lines_of_each_rank(tmp_path, monkeypatch):
    """train/doctor.py: NCCL's INFO lines go to a file per rank; the network ones are kept,
    each kind once; the variables the task started with are recorded before the override."""
    from train import doctor as compute

    for key in ("NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):  # set, then removed: restored after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    env, path = compute.capture_nccl(tmp_path, 3)
    assert env["NCCL_DEBUG"] == "WARN" and env["FI_PROVIDER"] == "efa"
    assert path == tmp_path / "doctor" / "nccl-rank3.log" and path.parent.is_dir()
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET,ENV")
    assert os.environ["NCCL_DEBUG_FILE"] == str(path)
    kept = compute.nccl_net_lines((FIX / "socket_no_ib.txt").read_text())
    assert sum("via NET/Socket" in line for line in kept) == 1  # channels repeat it with other numbers
    assert not any("P2P/CUMEM" in line or "cudaDriverVersion" in line or "Init START" in line for line in kept)
    assert netdiag.diagnose(kept, 1.0, EXPECTED, {}) == netdiag.diagnose(lines("socket_no_ib.txt"), 1.0, EXPECTED, {})
    many = "".join(f"h:1:1 [0] NCCL INFO NET/Plugin: lib{c}.so\n" for c in "abcdefgh")
    assert len(compute.nccl_net_lines(many)) == 8 and len(compute.nccl_net_lines(many, limit=4)) == 4
