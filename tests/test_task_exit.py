"""An interrupted Slurm task of the built-in trainer ends at once (train/job.py:
os._exit after flushing its logs), so it does not outlive Slurm's SIGTERM in interpreter
teardown; a user's code keeps its normal exit (its atexit hooks and threads)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = """
import atexit, signal, sys
import train.main
from train import job

def fake_run(run_dir, flag):
    flag._handler(signal.SIGUSR2, None) if {signalled} else None  # the job was preempted
    print("segment done", flush=True)
    return 0

train.main.run = fake_run
atexit.register(lambda: print("atexit ran", flush=True))
sys.exit(job.main(sys.argv[1]))
"""


@pytest.mark.parametrize("user_run,signalled,exits_at_once", [
    (False, True, True), (False, False, False), (True, True, False)])
def test_an_interrupted_trainer_task_exits_at_once(tmp_path, user_run, signalled, exits_at_once):
    if user_run:
        (tmp_path / "entrypoint.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(signalled=signalled), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "segment done" in proc.stdout
    assert ("atexit ran" not in proc.stdout) == exits_at_once, proc.stdout
