"""slurm/task_wrapper.sh: a warning signal while a task's Python starts is recorded, not fatal.

Slurm signals every process of a task (proctrack); here the test signals the wrapper's
process group the same way, while Python is still in its (slowed) start-up, before any
handler exists."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import REPO
from warm import pythonpath
from slurm.submitit_adapter import TASK_WRAPPER

# A task whose handler comes late: 1.5 s of "imports", then the harness's flag.
LATE_HANDLER = """
import sys, time
time.sleep(1.5)
from train.harness.preempt import PreemptionFlag
flag = PreemptionFlag().install()
deadline = time.time() + 1.5  # then a while with the handler in place
while flag.signum is None and time.time() < deadline:
    time.sleep(0.05)
print("signum", flag.signum, flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _start(wrapped: bool, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", LATE_HANDLER, *args]
    if wrapped:
        cmd = ["/bin/bash", str(TASK_WRAPPER), *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": pythonpath(), "TMPDIR": os.environ.get("TMPDIR", "/tmp")})


def test_usr2_during_start_up_reaches_the_handler_through_the_wrapper():
    proc = _start(True)
    time.sleep(0.4)  # Python is running, no handler yet
    os.killpg(proc.pid, signal.SIGUSR2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"signum {int(signal.SIGUSR2)}" in out


def test_without_the_wrapper_the_same_signal_kills_the_task():
    proc = _start(False)
    time.sleep(0.4)
    os.killpg(proc.pid, signal.SIGUSR2)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGUSR2


def test_exit_status_passes_through_and_no_signal_means_none():
    proc = _start(True, "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "signum None" in out, err


def test_sigterm_to_the_wrapper_alone_is_passed_on():
    proc = _start(True)
    time.sleep(2.2)  # the handler is installed: TERM only sets the flag, the task then exits 0
    os.kill(proc.pid, signal.SIGTERM)  # the wrapper only, as a launcher signalling the task's pid would
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"signum {int(signal.SIGTERM)}" in out, (out, err)
