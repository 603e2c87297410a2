"""Shared fixtures: run the launcher as a user would, and the real local Slurm cluster."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER_DIR = Path(os.environ.get("LOCALSLURM_DIR", "/tmp/localslurm"))


def launcher(args: List[str], cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m launcher ARGS`` in a subprocess, from ``cwd`` (runs land in cwd/runs)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def run_dir_of(output: str) -> Path:
    lines = [line for line in output.splitlines() if line.startswith("run_dir: ")]
    assert lines, f"no run_dir line in output:\n{output}"
    return Path(lines[-1].split(": ", 1)[1])


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """The local Slurm cluster of slurm/cluster/up.sh; started here when `make test` has not.

    Returns the environment (with SLURM_CONF) for CLI calls. Fails, never skips: a test
    that needs the cluster must not pass silently without it.
    """
    status = subprocess.run(["bash", str(REPO / "slurm/cluster/status.sh")], capture_output=True, text=True)
    if status.returncode != 0:
        up = subprocess.run(["bash", str(REPO / "slurm/cluster/up.sh")], capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            pytest.fail(f"could not start the local Slurm cluster:\n{up.stdout}\n{up.stderr}")
    conf = CLUSTER_DIR / "etc" / "slurm.conf"
    return dict(os.environ, SLURM_CONF=str(conf))
