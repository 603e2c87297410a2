"""Jobs after a training job (launcher.then, launcher/chain.py) on the real local cluster: a
run that fails (no restart left) has its chain cancelled by Slurm, and launcher.status says
why (a chain that runs, export, eval and a command: tests/test_eval_slurm.py). Without
Slurm: the refusals, and the step's batch script."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, job_gone, submit_run, wait_until
from helpers import compose_run
from launcher import chain
from spec.config import ConfigError
from spec.rundir import read_run_json

CMD = "cmd:ls {export_dir} > {run_dir}/listing.txt"


def test_a_chain_is_refused_when_it_cannot_run_and_its_script_waits_on_the_job(tmp_path):
    for overrides, says in ((["launcher.then=[export]"], "chains are Slurm jobs"),
                            (["+cluster=localslurm", "launcher.then=[export]"], "set checkpoint.every_steps"),
                            (["+cluster=localslurm", "launcher.then=[eval2]"], "launcher.then[0]='eval2'")):
        with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
            chain.check(compose_run(overrides))
    cfg = compose_run(["+cluster=localslurm", "checkpoint.every_steps=3", f"launcher.then=[export,'{CMD}']"])
    chain.check(cfg)
    text = chain.script(cfg, CMD, tmp_path / "run dir", "41", "python", None)
    assert "#SBATCH --dependency=afterok:41\n" in text and "#SBATCH --kill-on-invalid-dep=yes\n" in text
    assert text.endswith(f"exec ls '{tmp_path}/run dir/export' > '{tmp_path}/run dir'/listing.txt\n"), text


@pytest.mark.slurm
@pytest.mark.slow
def test_a_chain_is_cancelled_when_its_training_fails(tmp_path, slurm_cluster):
    """(A chain that runs after its training: tests/test_eval_slurm.py, export, eval and a command.)"""
    base = ["+cluster=localslurm", "cluster.nodes=2", "train.steps=6", "checkpoint.every_steps=3"]
    bad_job, bad_dir = submit_run(base + ["cluster.in_job_restarts=0", "fault.raise_at_step=2",
                                          "launcher.then=[export]"], tmp_path, slurm_cluster)
    wait_until(lambda: job_gone(bad_job, slurm_cluster), 240, f"job {bad_job} to leave the queue")
    [dropped] = read_run_json(bad_dir)["chain"]
    assert read_run_json(bad_dir)["status"] == "failed"
    def cancelled():
        out = subprocess.run([sys.executable, "-m", "launcher.status", str(bad_dir)], cwd=REPO, env=slurm_cluster,
                             capture_output=True, text=True).stdout
        return out if "CANCELLED" in out else None
    status = wait_until(cancelled, 60, "the cancelled chain in accounting")
    assert f"then: export: job {dropped['job_id']} CANCELLED" in status and "the training ended failed" in status
