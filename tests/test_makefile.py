"""The README's two commands, as make would run them in a fresh clone (``make -n -B``: every
target out of date, nothing run): ``make demo`` needs Python only (no system package
installed, no root), and ``make test`` installs the local cluster's packages before it
starts the cluster (a clean CI machine has none)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALLS = ("install-deps", "apt-get", "apt ", "dpkg", "sudo")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(target: str) -> str:
    proc = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_demo_installs_no_system_package():
    recipe = dry_run("demo")
    assert "pip install" in recipe and "-m launcher" in recipe, recipe  # setup, then the run
    assert not [word for word in INSTALLS if word in recipe], recipe


@pytest.mark.parametrize("target, groups", [("test", "slurm build"), ("cluster-up", "slurm"), ("test-fast", "build")])
def test_the_targets_that_need_packages_install_them_first(target, groups):
    lines = dry_run(target).splitlines()
    install = next(i for i, line in enumerate(lines) if "slurm/cluster/install-deps.sh" in line)
    assert lines[install].split("install-deps.sh")[1].split() == groups.split()
    if "slurm" in groups:
        assert install < next(i for i, line in enumerate(lines) if "slurm/cluster/up.sh" in line)
