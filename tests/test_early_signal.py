"""A USR2 that comes while a rank is still starting (importing torch: seconds) is kept
and acted on at the first step boundary: checkpoint, counted, stopped cleanly. Slurm may
send ``--signal``'s signal up to 60 s early (sbatch(1)), and a job can be preempted as it
starts. Before the flag was installed first, the signal met submitit's handler (the job
ended "timed-out and not checkpointable", never requeued: seen in a fresh-clone `make
test`) or, outside submitit, its default action killed the rank."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, launcher, run_dir_of
from warm import pythonpath
from launcher.local import free_port
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow

# Sends this process USR2 as the first `import torch` begins; then runs one entry point.
WRAPPER = """
import os, runpy, signal, sys

class SignalOnTorch:
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGUSR2)
        return None

sys.meta_path.insert(0, SignalOnTorch())
entry, run_dir = sys.argv[1:]
if entry == "job":  # what every Slurm task runs (submitit unpickles it and calls it)
    from train.job import TrainJob
    sys.exit(TrainJob(run_dir)())
sys.argv = ["train", run_dir]  # python -m train RUN_DIR (local runs, torchrun)
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("entry", ["job", "module"])
def test_signal_during_start_up_checkpoints_at_the_first_step(tmp_path, entry):
    prep = launcher(["cluster.gpus_per_node=1", "train.steps=5", "train.seq_len=32", "data.num_tokens=50000",
                     "launcher.dry_run=true"], cwd=tmp_path)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    run_dir = run_dir_of(prep.stdout)
    env = dict(os.environ, PYTHONPATH=pythonpath(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", WRAPPER, entry, str(run_dir)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: " + proc.stderr[-2000:]
    info = read_run_json(run_dir)
    assert info["status"] == "interrupted" and info["preemptions"] == 1, (info, proc.stderr[-2000:])
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000001"
