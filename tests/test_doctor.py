"""``python -m launcher.doctor``: the verdicts on reports of GPU nodes (no GPU here: the
reports are what train/doctor.py writes, with GPU health from the nvidia-smi fixtures),
its arguments and dry run, and the job itself locally (2 ranks) and on 2 nodes of the
local Slurm cluster."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, eligible_nodes, launcher, run_dir_of
from warm import pythonpath
from launcher import doctor
from spec.config import ClusterConfig
from spec.doctor import DOCTOR_JSON, ENTRYPOINT
from train.harness import health
from train.harness.affinity import Topology, parse_cpulist, share

FIX = Path(__file__).parent / "fixtures" / "nvidia_smi"
H100 = ClusterConfig(name="h100x8", backend="slurm", nodes=2, gpus_per_node=2, accelerator="gpu",
                     peak_tflops_bf16=989.0, intra_node_gbps=450, inter_node_gbps=50)


def gpu_rank(rank: int, host: str, **changes):
    """One rank's facts as train/doctor.py writes them on a healthy H100 node."""
    node, local = divmod(rank, 2)
    facts = {"rank": rank, "local_rank": local, "node": node, "host": host, "backend": "nccl",
             "device": f"cuda:{local}", "accelerator": "gpu", "gpu_binding": "node", "visible_gpus": 2,
             "gpu_uuid": f"GPU-{host}-{local}", "pci_bus_id": f"00000000:{0x18 + local:02X}:00.0", "cpus": 16,
             "slurm_cpus_per_task": 16, "cpu_list": f"{16 * local}-{16 * local + 15}", "cpu_numa": [local],
             "gpu_numa": local, "near_gpu": True, "cpu_bind": "gpu", "cpu_bind_reason": "",
             "torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.27.7",
             "python": "3.12.3", "matmul_tflops": 700.0, "intra_gbps": 380.0, "inter_gbps": 45.0}
    if local == 0:
        facts.update(driver="580.65.06", health={"gpus": 2, "xids": {}, "unhealthy": [], "throttled": []})
    facts.update(changes)
    return facts


def report(*ranks):
    return {"world_size": len(ranks), "backend": ranks[0]["backend"], "seconds": 3.0, "ranks": list(ranks)}


def healthy(per_rank=None):
    """Two healthy nodes of 2 ranks; ``per_rank``: rank -> the facts that differ."""
    return [gpu_rank(r, "gpu1" if r < 2 else "gpu2", **(per_rank or {}).get(r, {})) for r in range(4)]


def test_healthy_gpu_nodes_are_ok():
    judged = doctor.verdicts(report(*healthy()), H100)
    assert judged == {"gpu1": {"verdict": "ok", "reasons": []}, "gpu2": {"verdict": "ok", "reasons": []}}


def test_unhealthy_gpus_from_nvidia_smi_make_a_fault():
    """The node's health as health.py reads the real CSV forms: a pending row remap (0/1)."""
    gpus = health.parse_gpu_query((FIX / "query_gpu_h100_nounits.csv").read_text(), health.GPU_FIELDS)
    health._join(gpus, health.parse_gpu_query((FIX / "remapped_rows_nounits.csv").read_text(), health.REMAP_FIELDS),
                 health.REMAP_FIELDS[1:])
    sick = {"gpus": 4, "xids": None, "unhealthy": health.unhealthy_reasons(gpus), "throttled": []}
    judged = doctor.verdicts(report(*healthy({2: {"health": sick}})), H100)
    assert judged["gpu1"]["verdict"] == "ok"
    assert judged["gpu2"] == {"verdict": "fault", "reasons": ["GPU 1: 2 uncorrected ECC errors",
                                                              "GPU 1: row remapping pending (needs a reset)",
                                                              "GPU 2: row remapping failed"]}


@pytest.mark.parametrize("changes,reason", [
    ({"device": "cpu", "gpu_uuid": None, "pci_bus_id": None}, "rank 3 has no CUDA (torch 2.11.0+cu130, CUDA 13.0)"),
    ({"gpu_uuid": "GPU-gpu2-0"}, "ranks 2, 3 share GPU GPU-gpu2-0"),
    ({"visible_gpus": 1}, "rank 3 sees 1 GPU(s) for 2 tasks under gpu_binding=node"),
    ({"torch": "2.13.0+cu130"}, "torch 2.13.0+cu130 here, 2.11.0+cu130 on other nodes"),
], ids=["no_cuda", "shared_gpu", "binding", "torch_version"])
def test_device_and_version_faults(changes, reason):
    judged = doctor.verdicts(report(*healthy({3: changes})), H100)
    assert judged["gpu2"]["verdict"] == "fault" and reason in judged["gpu2"]["reasons"]
    assert judged["gpu1"]["verdict"] == "ok"


def test_a_driver_that_differs_is_a_fault_of_the_odd_node_out():
    ranks = [gpu_rank(r, f"gpu{r // 2 + 1}", **({"driver": "535.104.05"} if r == 4 else {})) for r in range(6)]
    judged = doctor.verdicts(report(*ranks), H100)
    assert [h for h, v in judged.items() if v["verdict"] == "fault"] == ["gpu3"]
    assert judged["gpu3"]["reasons"] == ["driver 535.104.05 here, 580.65.06 on other nodes"]


@pytest.mark.parametrize("changes,reason", [
    ({"matmul_tflops": 400.0}, "matmul 400 TFLOP/s < 0.5 x peak_tflops_bf16 989"),
    ({"intra_gbps": 100.0}, "intra-node all-reduce 100.0 GB/s < 0.5 x intra_node_gbps 450"),
    ({"inter_gbps": 12.5}, "inter-node all-reduce 12.5 GB/s < 0.5 x inter_node_gbps 50"),
    ({"cpus": 1}, "rank 2 may use 1 CPU(s), cpus_per_task=8"),
    ({"health": {"gpus": 2, "unhealthy": [], "throttled": ["GPU 1: hw_thermal_slowdown"]}},
     "clocks slowed: GPU 1: hw_thermal_slowdown"),
    ({"cpu_list": "16-31", "cpu_numa": [1], "near_gpu": False, "cpu_bind": "kept",
      "cpu_bind_reason": "cluster.cpu_bind=none: the task's CPUs, left as they are"},
     "rank 2 runs on CPUs 16-31 of NUMA node(s) 1, its GPU on NUMA node 0 (cluster.cpu_bind=none: the task's CPUs, "
     "left as they are)"),
    ({"cpu_list": "0-31", "cpu_numa": [0, 1], "cpu_bind_reason": ""},
     "rank 2 runs on CPUs 0-31 of NUMA node(s) 0,1, its GPU on NUMA node 0"),
], ids=["matmul", "intra", "inter", "cpus", "throttled", "far_numa_node", "both_numa_nodes"])
def test_slow_nodes(changes, reason):
    cluster = ClusterConfig(**{**H100.__dict__, "cpus_per_task": 8})
    judged = doctor.verdicts(report(*healthy({2: changes})), cluster)
    assert judged["gpu2"]["verdict"] == "slow" and reason in judged["gpu2"]["reasons"]
    assert judged["gpu1"]["verdict"] == "ok"


def test_a_node_far_below_the_others_is_slow_even_without_a_peak():
    ranks = [gpu_rank(r, f"gpu{r // 2 + 1}", **({"matmul_tflops": 300.0} if r == 5 else {})) for r in range(6)]
    cluster = ClusterConfig(**{**H100.__dict__, "peak_tflops_bf16": None})
    judged = doctor.verdicts(report(*ranks), cluster)
    assert judged["gpu3"] == {"verdict": "slow", "reasons": ["matmul 300 TFLOP/s < 0.7 x median of nodes 700"]}


def test_gloo_bandwidth_is_informative_only():
    cpu = [dict(gpu_rank(r, f"node{r // 2 + 1}"), backend="gloo", device="cpu", accelerator="cpu", visible_gpus=0,
                gpu_uuid=None, pci_bus_id=None, matmul_tflops=0.008, intra_gbps=0.2, inter_gbps=0.5)
           for r in range(4)]
    for r in cpu[::2]:
        r["health"] = {"skipped": "no nvidia-smi on this node"}
    rep = report(*cpu)
    judged = doctor.verdicts(rep, H100)  # GPU figures: no verdict against them on gloo
    assert {v["verdict"] for v in judged.values()} == {"ok"}
    text = doctor.render(rep, H100, judged)
    assert "bandwidths are informative only" in text and "GPU health: skipped (no nvidia-smi on this node)" in text
    assert "verdict node1: ok" in text and "verdict node2: ok" in text


def test_render_has_a_row_per_rank_and_a_verdict_per_node():
    rep = report(*healthy({3: {"gpu_uuid": "GPU-gpu2-0"}}))
    text = doctor.render(rep, H100, doctor.verdicts(rep, H100))
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["node", "rank", "local", "device"]
    assert [line.split()[:2] for line in lines[2:6]] == [["gpu1", "0"], ["gpu1", "1"], ["gpu2", "2"], ["gpu2", "3"]]
    assert "cuda:1 00000000:19:00.0" in lines[3] and "node/2" in lines[3] and "16/16" in lines[3]
    assert "numa cpu/gpu" in lines[1] and " 16-31 " in lines[3] and " 1/1 " in lines[3]  # rank 1: CPUs, NUMA nodes
    assert "gpu1: torch 2.11.0+cu130, CUDA 13.0, NCCL 2.27.7, driver 580.65.06; GPU health: 2 GPU(s), 0 fault(s)" in text
    assert "verdict gpu2: fault (ranks 2, 3 share GPU GPU-gpu2-0)" in text and "informative" not in text


def test_doctor_args():
    args = doctor.doctor_args(["+cluster=h100x8", "cluster.nodes=2"], now=0)
    assert args[:2] == ["+cluster=h100x8", "cluster.nodes=2"]
    assert {f"entrypoint={ENTRYPOINT}", "launcher.wait=true", "launcher.job_name=sto-doctor"} <= set(args)
    run_dir = doctor._value(args, "launcher.run_dir")
    assert run_dir.startswith("runs/doctor/h100x8-2n-19")
    kept = doctor.doctor_args(["launcher.run_dir=x", "launcher.wait=false", f"entrypoint={ENTRYPOINT}"])
    assert doctor._value(kept, "launcher.run_dir") == "x" and doctor._value(kept, "launcher.wait") == "false"
    assert kept.count(f"entrypoint={ENTRYPOINT}") == 1
    for bad in (["-m", "cluster.nodes=1,2"], ["entrypoint=train.py"]):
        with pytest.raises(ValueError):
            doctor.doctor_args(bad)


def doctor_cli(args, cwd, env=None, timeout=300):
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath()}
    return subprocess.run([sys.executable, "-m", "launcher.doctor", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    proc = doctor_cli(["+cluster=h100x8", "cluster.nodes=2", "launcher.dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --job-name=sto-doctor" in proc.stdout
    assert f"every task runs {ENTRYPOINT}(cfg)" in proc.stdout and "dry run: nothing submitted" in proc.stdout
    assert not (run_dir_of(proc.stdout) / DOCTOR_JSON).exists() and "verdict" not in proc.stdout


def test_bad_input_exits_2(tmp_path):
    proc = doctor_cli(["+cluster=local", "entrypoint=mine.py"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: entrypoint=mine.py")


def check_report(proc, hosts, ranks_per_node, n_hosts=None):
    """``hosts``: the nodes the ranks ran on, or (``n_hosts`` given) those they may have run on."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    rep = json.loads((run_dir / DOCTOR_JSON).read_text())
    ran_on = sorted({r["host"] for r in rep["ranks"]})
    if n_hosts is None:
        assert ran_on == hosts
    else:
        assert len(ran_on) == n_hosts and set(ran_on) <= set(hosts), (ran_on, hosts)
        hosts = ran_on
    assert rep["backend"] == "gloo" and rep["world_size"] == len(hosts) * ranks_per_node
    assert all(r["device"] == "cpu" and r["cpus"] >= 1 and r["matmul_tflops"] > 0 for r in rep["ranks"])
    # placed as a training rank is (train/harness/affinity.py): no GPU, an even split of the task's CPUs
    assert all(r["cpu_bind"] == "split" and r["gpu_numa"] is None and r["cpus"] == len(parse_cpulist(r["cpu_list"]))
               for r in rep["ranks"]), rep["ranks"]
    assert all((r["intra_gbps"] or 0) > 0 for r in rep["ranks"]) == (ranks_per_node > 1)
    assert all((r["inter_gbps"] or 0) > 0 for r in rep["ranks"]) == (len(hosts) > 1)
    assert "gloo on CPU: bandwidths are informative only" in proc.stdout
    for host in hosts:  # on a machine this loaded, CPU matmuls may differ: slow is allowed, no fault
        assert f"verdict {host}: ok" in proc.stdout or f"verdict {host}: slow" in proc.stdout
    return rep


@pytest.mark.slow
def test_local_two_ranks(tmp_path):
    proc = doctor_cli(["+cluster=local"], tmp_path)
    rep = check_report(proc, [socket.gethostname()], 2)
    mine = sorted(os.sched_getaffinity(0))  # the forked ranks' shares of this machine's CPUs
    assert [parse_cpulist(r["cpu_list"]) for r in rep["ranks"]] == [share(mine, k, 2, Topology()) for k in range(2)]


@pytest.mark.slow
@pytest.mark.slurm
def test_two_nodes_of_the_local_cluster(tmp_path, slurm_cluster):
    proc = doctor_cli(["+cluster=localslurm", "cluster.nodes=2"], tmp_path, env=slurm_cluster)
    rep = check_report(proc, eligible_nodes(slurm_cluster), 2, n_hosts=2)  # the suite may confine it to a pair
    assert all(r["slurm_cpus_per_task"] == 1 for r in rep["ranks"])  # srun gave each task its CPUs
    assert "job " in proc.stdout and ": COMPLETED" in proc.stdout


def test_gpu_facts_of_a_rank_with_cuda_mocked(monkeypatch):
    """What train/doctor.py records of a GPU rank (CUDA mocked: no GPU here)."""
    from types import SimpleNamespace

    import torch

    from spec.config import RunConfig
    from train import doctor as compute

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="GPU-5e6f", pci_domain_id=0, pci_bus_id=0x2A,
                            pci_device_id=0, total_memory=80 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("STO_DEVICE", "cuda:0")
    cfg = RunConfig(cluster=ClusterConfig(accelerator="gpu", gpu_binding="task"))
    facts = compute.device_facts(torch.device("cuda", 0), cfg)
    assert facts == {"device": "cuda:0", "accelerator": "gpu", "gpu_binding": "task", "cuda_visible_devices": "1",
                     "sto_device": "cuda:0", "visible_gpus": 1, "gpu_name": "NVIDIA H100 80GB HBM3",
                     "gpu_uuid": "GPU-5e6f", "pci_bus_id": "00000000:2A:00.0", "gpu_mem_gb": 80.0}
    assert compute.versions()["nccl"] == "2.27.7"
    # the same PCI address as nvidia-smi writes it: the health report's GPU is this rank's
    smi = health.parse_gpu_query((FIX / "query_gpu_h100_nounits.csv").read_text(), health.GPU_FIELDS)
    assert [g["index"] for g in smi if g["pci.bus_id"] == facts["pci_bus_id"]] == [1]
