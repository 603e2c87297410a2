"""The ``binding/*`` rows of bench/gpu_check.py: local rank 3 of a node whose tasks each
see one GPU, as under ``--gpus-per-task=1`` / ``--gpu-bind=single:1``.

The run directory is prepared by the launcher's dry run (ZeRO-2: DeepSpeed takes its
device from LOCAL_RANK unless told, the "invalid device ordinal" of per-task binding),
then the task runs as torchrun would start it (``python -m train RUN_DIR``) with RANK 0,
WORLD_SIZE 1, LOCAL_RANK 3, LOCAL_WORLD_SIZE 4 and the caller's one-device
CUDA_VISIBLE_DEVICES. ``task``: it trains on cuda:0 (run.json: completed, backend nccl);
``node``: it is refused at start (run.json: failed, failure gpu_binding) in one line.
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


def _prepare(binding: str, scratch: Path) -> Path:
    run_dir = scratch / f"binding_{binding}"
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
