"""Each rank's CPUs next to its GPU (train/harness/affinity.py, ``cluster.cpu_bind``): the
placement on a fake sysfs tree of a DGX-like node (two NUMA nodes of 16 CPUs, GPUs 0-3 on
node 0 and 4-7 on node 1), the cases where the task's CPUs are kept, CPU lists, and a
forked local run whose two ranks each run on their own share of this machine's CPUs."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import launcher, run_dir_of
from spec.config import ClusterConfig
from train.harness import affinity
from train.harness.affinity import Topology, format_cpulist, parse_cpulist, pci_address, plan, share

# A DGX H100's GPU bus numbers; a NIC on node 0 that is not a GPU
GPUS = [f"0000:{bus:02x}:00.0" for bus in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)]
NIC = "0000:1a:00.0"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sysfs(root: Path, nodes=("0-15", "16-31"), siblings=None) -> Topology:
    """``root``/sys with NUMA nodes of ``nodes`` (cpulists), GPUs 0-3 on node 0 and 4-7 on node
    1, a NIC; ``siblings``: cpu -> its thread_siblings_list."""
    for n, cpus in enumerate(nodes):
        write(root / f"sys/devices/system/node/node{n}/cpulist", cpus)
    for i, gpu in enumerate(GPUS):
        dev = root / "sys/bus/pci/devices" / gpu
        write(dev / "vendor", "0x10de")
        write(dev / "class", "0x030200")
        write(dev / "numa_node", str(i // 4))
        write(dev / "local_cpulist", nodes[i // 4])
    write(root / "sys/bus/pci/devices" / NIC / "vendor", "0x15b3")
    write(root / "sys/bus/pci/devices" / NIC / "class", "0x020700")
    write(root / "sys/bus/pci/devices" / NIC / "numa_node", "0")
    for cpu, sib in (siblings or {}).items():
        write(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", sib)
    return Topology(root)


def test_cpulists():
    assert parse_cpulist("0-3,8-11") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("0,2,4\n") == [0, 2, 4] and parse_cpulist("") == [] and parse_cpulist("7") == [7]
    assert parse_cpulist("8-9,0-1,1") == [0, 1, 8, 9]
    assert format_cpulist([8, 0, 1, 2, 11, 10]) == "0-2,8,10-11" and format_cpulist([]) == ""
    assert format_cpulist(parse_cpulist("0-55,112-167")) == "0-55,112-167"
    for bad in ("a", "3-1", "1-", "0-3;4"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_pci_addresses_as_sysfs_names_them():
    assert pci_address("00000000:DB:00.0") == "0000:db:00.0"  # nvidia-smi's form
    assert pci_address((0, 0x2A, 0)) == "0000:2a:00.0"  # torch's numbers
    assert pci_address("0000:18:00.0") == "0000:18:00.0"
    with pytest.raises(ValueError):
        pci_address("GPU-5e6f")


def test_eight_gpus_on_two_numa_nodes_get_four_cpus_each_of_their_gpus_node(tmp_path):
    topo = fake_sysfs(tmp_path)
    assert topo.gpus() == GPUS and topo.numa_nodes() == {0: list(range(16)), 1: list(range(16, 32))}
    for peers in (GPUS, None):  # binding node: the ranks' GPUs from torch; task: every GPU sysfs lists
        for rank in range(8):
            p = plan(range(32), rank, 8, topo, gpu=GPUS[rank], gpus=peers)
            first = 16 * (rank // 4) + 4 * (rank % 4)
            assert p.cpus == tuple(range(first, first + 4)) and p.how == "gpu" and p.near_gpu, (rank, p)
            assert p.numa_nodes == (rank // 4,) and p.gpu_numa == rank // 4
    line = plan(range(32), 5, 8, topo, gpu="00000000:AB:00.0", gpus=GPUS).line(5)
    assert line == "rank 5: CPUs 20-23 (NUMA node 1, its GPU's)"


def test_a_task_slurm_restricted_gets_the_intersection_split(tmp_path):
    topo = fake_sysfs(tmp_path)
    task = parse_cpulist("0-7,16-23")
    got = [format_cpulist(plan(task, r, 8, topo, gpu=GPUS[r], gpus=GPUS).cpus) for r in range(8)]
    assert got == ["0-1", "2-3", "4-5", "6-7", "16-17", "18-19", "20-21", "22-23"]


def test_no_cpu_on_the_gpus_node_falls_back_to_an_even_split_and_says_why(tmp_path):
    topo = fake_sysfs(tmp_path)
    p = plan(range(16, 32), 1, 8, topo, gpu=GPUS[1], gpus=GPUS)
    assert p.how == "fallback" and p.cpus == (18, 19) and p.near_gpu is False
    assert p.reason == ("the task has no CPU on its GPU's NUMA node 0 (it was given 16-31): an even split of the "
                        "task's 16 CPUs among 8 local ranks")
    assert p.line(1).startswith("rank 1: CPUs 18-19 (NUMA node 1; its GPU 0000:2a:00.0 is on NUMA node 0; the task")
    unknown = plan(range(32), 0, 2, Topology(tmp_path / "nothing"), gpu=GPUS[0])
    assert unknown.how == "fallback" and "NUMA node of its GPU 0000:18:00.0 is unknown" in unknown.reason
    assert plan(range(4), 1, 2, topo, on_gpu=True).reason.startswith("its GPU's PCI address is unknown")


def test_cpu_cluster_splits_the_tasks_cpus_evenly(tmp_path):
    topo = fake_sysfs(tmp_path)
    ranks = [plan(range(32), r, 2, topo) for r in range(2)]
    assert [format_cpulist(p.cpus) for p in ranks] == ["0-15", "16-31"]
    assert [p.numa_nodes for p in ranks] == [(0,), (1,)] and {p.how for p in ranks} == {"split"}
    assert ranks[1].line(3) == ("rank 3: CPUs 16-31 (NUMA node 1; an even split of the task's 32 CPUs among 2 "
                                "local ranks)")
    assert [share(range(5), k, 2) for k in range(2)] == [[0, 1, 2], [3, 4]]  # the first slice one larger
    assert [share([6], k, 2) for k in range(2)] == [[6], [6]]  # fewer CPUs than ranks: shared


def test_hyperthread_siblings_stay_in_one_slice(tmp_path):
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    topo = fake_sysfs(tmp_path, nodes=("0-3,8-11", "4-7,12-15"), siblings=siblings)
    assert topo.cores([0, 1, 8, 9]) == [[0, 8], [1, 9]]
    got = [format_cpulist(plan(range(16), r, 4, topo, gpu=GPUS[r], gpus=GPUS[:4]).cpus) for r in range(4)]
    assert got == ["0,8", "1,9", "2,10", "3,11"]  # not 0-1 / 2-3 / 8-9 / 10-11: two ranks on one core
    assert share([0, 8], 1, 2, topo) == [8]  # one core for two ranks: its threads


def test_an_explicit_or_existing_srun_binding_is_kept():
    assert affinity.srun_binding(["--cpu-bind=cores", "--mpi=pmix"], {}) == "--cpu-bind=cores"
    assert affinity.srun_binding(["--cpu_bind=verbose,map_cpu:0,4"], {}) == "--cpu_bind=verbose,map_cpu:0,4"
    assert affinity.srun_binding(["--cpu-bind=none"], {}) is None  # no binding: the harness places
    assert affinity.srun_binding(["--cpu-bind=verbose,none"], {}) is None
    assert "SLURM_CPU_BIND=sockets" in affinity.srun_binding([], {"SLURM_CPU_BIND": "sockets"})
    assert affinity.slurm_bound({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}) == "SLURM_CPU_BIND_TYPE=mask_cpu:"
    assert affinity.slurm_bound({"SLURM_CPU_BIND_TYPE": "none"}) is None and affinity.slurm_bound({}) is None


def test_cpu_bind_takes_gpu_or_none():
    from spec.config import RunConfig
    from spec.validate import ConfigError, validate

    assert ClusterConfig().cpu_bind == "gpu"
    validate(RunConfig(cluster=ClusterConfig(cpu_bind="none")))
    with pytest.raises(ConfigError, match="cluster.cpu_bind='socket' is not one of gpu, none"):
        validate(RunConfig(cluster=ClusterConfig(cpu_bind="socket")))


@pytest.fixture
def fake_process(monkeypatch):
    """bind_rank in this process without touching its CPUs: the task's CPUs are 0-31, apply records."""
    state = {"cpus": set(range(32)), "applied": []}
    monkeypatch.setattr(affinity, "_PLACED", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(state["cpus"]))

    def apply(cpus):
        state["applied"].append(sorted(cpus))
        state["cpus"] = set(cpus)
    monkeypatch.setattr(affinity, "apply", apply)
    return state


@pytest.mark.parametrize("cluster,env,why", [
    (ClusterConfig(cpu_bind="none"), {}, "cluster.cpu_bind=none"),
    (ClusterConfig(backend="slurm", srun_args=["--cpu-bind=cores"]), {}, "srun binds them as asked (--cpu-bind=cores"),
    (ClusterConfig(backend="slurm"), {"SLURM_STEP_ID": "0", "SLURM_CPU_BIND_TYPE": "mask_cpu:"},
     "srun bound this task to them (SLURM_CPU_BIND_TYPE=mask_cpu:)"),
], ids=["cpu_bind_none", "srun_args", "srun_bound"])
def test_bind_rank_keeps_what_it_must_not_change(tmp_path, fake_process, cluster, env, why):
    lines = []
    p = affinity.bind_rank(cluster, 1, 2, log=lines.append, rank=3, env=env, topo=fake_sysfs(tmp_path))
    assert p.how == "kept" and p.cpus == tuple(range(32)) and fake_process["applied"] == []
    assert lines == [p.line(3)] and why in lines[0] and lines[0].startswith("rank 3: CPUs 0-31 (NUMA nodes 0,1; ")


def test_bind_rank_places_once_per_process(tmp_path, fake_process, monkeypatch):
    topo = fake_sysfs(tmp_path)
    monkeypatch.setattr(affinity, "gpu_addresses", lambda cluster, local, n, device: (GPUS[local], GPUS))
    lines = []
    gpu = ClusterConfig(backend="slurm", accelerator="gpu", gpus_per_node=8)
    p = affinity.bind_rank(gpu, 5, 8, log=lines.append, rank=13, env={}, topo=topo)
    assert fake_process["applied"] == [[20, 21, 22, 23]] and affinity.placed() is p
    assert lines == ["rank 13: CPUs 20-23 (NUMA node 1, its GPU's)"]
    assert affinity.bind_rank(gpu, 5, 8, log=lines.append, topo=topo) is p and len(lines) == 1  # placed already
    assert p.facts() == {"cpu_list": "20-23", "cpu_numa": [1], "gpu_numa": 1, "near_gpu": True, "cpu_bind": "gpu",
                         "cpu_bind_reason": ""}
    monkeypatch.setattr(affinity, "_PLACED", None)
    cpu = affinity.bind_rank(ClusterConfig(), 1, 2, env={}, topo=topo)  # a CPU profile: half the task's CPUs
    assert cpu.how == "split" and cpu.cpus == (22, 23) and fake_process["applied"][-1] == [22, 23]


@pytest.mark.parametrize("binding,count,local,index", [("node", 8, 5, 5), ("task", 1, 5, 0)])
def test_gpu_addresses_from_torch_with_cuda_mocked(tmp_path, fake_process, monkeypatch, binding, count, local, index):
    """The GPU's PCI address as torch gives it (pci_domain_id / pci_bus_id / pci_device_id, the
    fields torch.numa's own binding reads; CUDA mocked: no GPU here), then the placement."""
    from types import SimpleNamespace

    import torch

    buses = [int(g.split(":")[1], 16) for g in GPUS]
    visible = buses if count == 8 else [buses[local]]  # binding task: the task sees its own GPU only
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        pci_domain_id=0, pci_bus_id=visible[i], pci_device_id=0))
    gpu = ClusterConfig(backend="slurm", accelerator="gpu", gpus_per_node=8, gpu_binding=binding)
    own, peers = affinity.gpu_addresses(gpu, local, 8)
    assert own == GPUS[local] and peers == (GPUS if binding == "node" else None)
    assert affinity.gpu_addresses(gpu, local, 8, SimpleNamespace(type="cuda", index=index))[0] == GPUS[local]
    lines = []
    p = affinity.bind_rank(gpu, local, 8, log=lines.append, rank=local, env={}, topo=fake_sysfs(tmp_path))
    assert lines == ["rank 5: CPUs 20-23 (NUMA node 1, its GPU's)"] and fake_process["applied"] == [[20, 21, 22, 23]]
    monkeypatch.setattr(affinity, "_PLACED", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no CUDA: the harness refuses the task itself
    p = affinity.bind_rank(gpu, local, 8, env={}, topo=fake_sysfs(tmp_path))
    assert p.how == "kept" and p.reason.startswith("its GPU is unknown here (DeviceError: no CUDA device on ")


def test_node_topology_for_the_node_facts(tmp_path):
    facts = affinity.node_topology(fake_sysfs(tmp_path))
    assert facts["numa_nodes"] == {"0": "0-15", "1": "16-31"}
    assert facts["gpu_numa"] == {gpu: i // 4 for i, gpu in enumerate(GPUS)}  # the NIC is no GPU


@pytest.mark.slow
def test_forked_local_ranks_each_run_on_their_share(tmp_path):
    """A local run of 2 ranks (rank 0 forks rank 1): each logs the CPUs the kernel gives it
    after the placement, an even split of this machine's CPUs (on 2 cores: one each)."""
    proc = launcher(["train.steps=2", "cluster.gpus_per_node=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = run_dir_of(proc.stdout) / "logs"
    mine = sorted(os.sched_getaffinity(0))
    topo = Topology()
    for rank in range(2):
        found = re.findall(rf"rank {rank}: CPUs (\S+) \((.*)\)$", (logs / f"rank{rank}.log").read_text(), re.M)
        assert len(found) == 1, found  # once: the fork placed it, the harness's start did not again
        cpus, why = found[0]
        assert parse_cpulist(cpus) == share(mine, rank, 2, topo), (rank, cpus, mine)
        assert f"an even split of the task's {len(mine)} CPU" in why
