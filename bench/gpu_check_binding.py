"""The ``binding/*`` rows of bench/gpu_check.py: local rank 3 of a node whose tasks each
see one GPU, as under ``--gpus-per-task=1`` / ``--gpu-bind=single:1``.

The run directory is prepared by the launcher's dry run (ZeRO-2: DeepSpeed takes its
device from LOCAL_RANK unless told, the "invalid device ordinal" of per-task binding),
then the task runs as torchrun would start it (``python -m train RUN_DIR``) with RANK 0,
WORLD_SIZE 1, LOCAL_RANK 3, LOCAL_WORLD_SIZE 4 and the caller's one-device
CUDA_VISIBLE_DEVICES. ``task``: it trains on cuda:0 (run.json: completed, backend nccl);
``node``: it is refused at start (run.json: failed, failure gpu_binding) in one line.
``binding/agent`` (:func:`agent_row`): the rank a node's agent forks, its device and its
CPUs against its GPU's.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}


def _prepare(binding: str, scratch: Path, name: str = "") -> Path:
    run_dir = scratch / (name or f"binding_{binding}")
    from bench.gpu_check import GPU, SHORT, launcher_argv  # the other rows' one-GPU profile and short run

    argv = launcher_argv(*GPU, f"cluster.gpu_binding={binding}", "+strategy=zero2", *SHORT, "train.steps=3",
                         f"launcher.run_dir={run_dir}", "launcher.dry_run=true")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"dry run failed: {proc.stdout[-800:]}{proc.stderr[-800:]}")
    return run_dir


def _decision(binding: str) -> str:
    """The harness's rule for this task (spec.device), checked without a GPU."""
    from spec.device import DeviceError, device_index

    try:
        return f"cuda:{device_index(binding, 3, 4, 1, '0', 'this-host')}"
    except DeviceError as exc:
        return f"refused: {exc}"


def binding_row(binding: str, scratch: Path, dry: bool) -> int:
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import pythonpath
    decision = _decision(binding)
    expected = "cuda:0" if binding == "task" else "refused: "
    print(f"gpu_binding={binding}, local rank 3 of 4, one visible device: {decision}")
    if not decision.startswith(expected) or (binding == "node" and "cluster.gpu_binding=task" not in decision):
        return 1
    run_dir = _prepare(binding, scratch)
    if dry:
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **TASK, "MASTER_PORT": str(port), "PYTHONPATH": pythonpath()}  # the wheels stay
    proc = subprocess.run([sys.executable, "-m", "train", str(run_dir)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    print(proc.stdout[-2000:] + proc.stderr[-2000:])
    info = json.loads((run_dir / "run.json").read_text())
    print(f"exit {proc.returncode}; run.json: status {info.get('status')}, backend {info.get('backend')}, "
          f"failure {info.get('failure')}")
    if binding == "task":
        return 0 if proc.returncode == 0 and info.get("status") == "completed" and info.get("backend") == "nccl" else 1
    refused = proc.returncode != 0 and info.get("failure") == "gpu_binding"
    return 0 if refused and "cluster.gpu_binding=task" in proc.stdout + proc.stderr else 1


# The node agent's environment of a one-node step: srun task 0 of 1 (train/harness/agent.py).
AGENT_TASK = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
              "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_ID": "0",
              "SLURM_JOB_NODELIST": "localhost", "STO_AGENT": "1"}


def agent_row(scratch: Path, dry: bool) -> int:
    """``binding/agent``: the node's agent as srun starts it (one task a node, ``STO_AGENT``
    ranks), forking its rank on this GPU (binding ``node``): the rank's device is cuda:0
    and its CPUs lie on its GPU's NUMA node (sysfs ``local_cpulist`` of the GPU's PCI
    address), as the rank's log and run.json say. ``--dry``: the rank's variables only."""
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import pythonpath
    from slurm.env import task_identity
    from train.harness.agent import is_agent, rank_env

    env = {**os.environ, **AGENT_TASK, "SLURM_JOB_ID": str(20000 + os.getpid() % 5000)}
    child = task_identity({**env, **rank_env(env, 0, 1, None)})
    print(f"agent task: is_agent {is_agent(env)}; its rank: RANK {child.rank} of {child.world_size}, "
          f"local {child.local_rank}, launcher {child.launcher}")
    if not is_agent(env) or (child.rank, child.world_size, child.order_error()) != (0, 1, None):
        return 1
    run_dir = _prepare("node", scratch, name="binding_agent")
    if dry:
        return 0
    env["PYTHONPATH"] = pythonpath()
    code = "import sys; from train.job import main; sys.exit(main(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    print(proc.stdout[-1500:] + proc.stderr[-1500:])
    info = json.loads((run_dir / "run.json").read_text())
    log = (run_dir / "logs" / "rank0.log").read_text()
    placed = next((ln.split(" rank0 ", 1)[1] for ln in log.splitlines() if " rank 0: CPUs " in ln), "not placed")
    device = next((ln.split(" device ", 1)[1].split()[0] for ln in log.splitlines() if " device " in ln), "?")
    local = _gpu_local_cpus()
    print(f"exit {proc.returncode}; run.json: status {info.get('status')}, backend {info.get('backend')}; "
          f"device {device}; {placed}; GPU 0's local_cpulist {local}")
    near = "its GPU's" in placed
    ok = proc.returncode == 0 and info.get("status") == "completed" and info.get("backend") == "nccl"
    return 0 if ok and device == "cuda:0" and near else 1


def _gpu_local_cpus() -> str:
    """sysfs ``local_cpulist`` of CUDA device 0's PCI address ("?" when unreadable)."""
    try:
        import torch

        from train.harness.affinity import Topology, _torch_pci, format_cpulist

        return format_cpulist(Topology().local_cpus(_torch_pci(0))) or "?"
    except Exception as exc:  # noqa: BLE001 - a row's printout
        return f"? ({type(exc).__name__}: {exc})"
