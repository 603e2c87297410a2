"""Jobs after a training job (launcher.then, launcher/chain.py) on the real local cluster: a
2-node run's export and a command wait on it (afterok, in `scontrol show job`), then run
and leave the Hugging Face directory and the command's output; a run that fails (no restart
left) has its chain cancelled by Slurm, and launcher.status says why. Without Slurm: the
refusals, and the step's batch script."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, final_states, job_gone, launcher, submit_run, wait_until
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
def test_a_chain_runs_after_training_and_is_cancelled_when_it_fails(tmp_path, slurm_cluster):
    base = ["+cluster=localslurm", "cluster.nodes=2", "train.steps=6", "checkpoint.every_steps=3"]
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    proc = launcher(base + [f"launcher.then=[export,'{CMD}']"], cwd=tmp_path / "ok", env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = next(line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job"))
    then = re.findall(r"^then: .*: job (\d+) \(afterok:\d+\)$", proc.stdout, re.M)
    assert len(then) == 2, proc.stdout
    shown = subprocess.run(["scontrol", "show", "job", "-o", then[0]], env=slurm_cluster, capture_output=True,
                           text=True).stdout
    assert f"Dependency=afterok:{job}" in shown or "Dependency=(null)" in shown, shown  # met once training ended
    bad_job, bad_dir = submit_run(base + ["cluster.in_job_restarts=0", "fault.raise_at_step=2",
                                          "launcher.then=[export]"], tmp_path / "bad", slurm_cluster)
    ok_dir = next((tmp_path / "ok" / "runs").glob("*launcher.then*"))
    for j in [job, bad_job, *then]:  # the chain waits for the pair's nodes after the training, with other jobs
        wait_until(lambda: job_gone(j, slurm_cluster), 240, f"job {j} to leave the queue")
    assert [final_states(j, slurm_cluster) for j in then] == [["COMPLETED"], ["COMPLETED"]]
    assert read_run_json(ok_dir)["status"] == "completed"
    assert (ok_dir / "export" / "config.json").is_file() and "config.json" in (ok_dir / "listing.txt").read_text()
    [dropped] = read_run_json(bad_dir)["chain"]
    assert read_run_json(bad_dir)["status"] == "failed"
    def cancelled():
        out = subprocess.run([sys.executable, "-m", "launcher.status", str(bad_dir)], cwd=REPO, env=slurm_cluster,
                             capture_output=True, text=True).stdout
        return out if "CANCELLED" in out else None
    status = wait_until(cancelled, 60, "the cancelled chain in accounting")
    assert f"then: export: job {dropped['job_id']} CANCELLED" in status and "the training ended failed" in status
