"""A rank that dies without a word, on the real local Slurm cluster. With node agents (the
default: srun starts one task a node, which forks the node's ranks) the agent sees its rank
die at once, records it before stopping the others, and forks fresh ranks for the restart
inside the same srun (train/harness/agent.py). One srun task a rank
(cluster.gpu_binding=task): srun's --kill-on-bad-exit=1 ends the step at once, the batch
script's step loop reads srun's report of the dead task and restarts the step
(train.harness.restart.after_srun). Either way the run completes under the same job id,
well before the hang check (cluster.hang_timeout_s=300) could have fired.
Ranks are numbered node by node: the agents number them whatever srun's --distribution; one
task a rank refuses a cyclic distribution at launch, before any job.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from conftest import final_states, job_gone, launcher, submit_run, wait_until
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Rank 1 SIGKILLs itself on the first try, after a logged step, while rank 0 sleeps outside
# any collective (it would wait there until the job's time limit if nothing watched rank 1);
# the second try ends at once. The marker holds the time of the kill.
SCRIPT = """
import os, signal, time
from pathlib import Path
from train import session

rank = int(os.environ["RANK"])
marker = Path(session.run_dir) / "killed"
if marker.exists():
    session.log(2, loss=0.5)
else:
    session.log(1, loss=1.0)
    time.sleep(2)  # heartbeats carry the step
    if rank == 1:
        marker.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""


def killed_and_restarted(tmp_path, env, extra):
    """The script's run with ``extra``: its one in_job_restarts entry, checked alike for both modes."""
    script = tmp_path / "killed.py"
    script.write_text(SCRIPT)
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
                               "cluster.hang_timeout_s=300", f"entrypoint={script}", *extra], tmp_path, env)
    wait_until(lambda: job_gone(job, env), 90, f"job {job} to leave the queue")
    info = read_run_json(run_dir)
    assert info["status"] == "completed", info
    assert (info["job_id"], info["restart_count"], info["segments"]) == (job, 0, 2)
    [restart] = info["in_job_restarts"]
    assert (restart["job_id"], restart["reason"], restart["rank"], restart["signal"]) == (
        job, "rank_failure", 1, "SIGKILL"), restart
    assert restart["node"] == info["hostnames"][1] and restart["step"] == 2 and restart["downtime_s"] > 0
    killed = float((run_dir / "killed").read_text())
    # the entry's own clock: recorded and restarted long before a hang check (300 s) could fire
    assert killed <= restart["failed_at"] < restart["restarted_at"] < killed + 60, (killed, restart)
    assert final_states(job, env) == ["COMPLETED"]
    return job, run_dir, restart


def test_a_users_rank_killed_outside_any_collective_is_seen_by_its_agent(tmp_path, slurm_cluster):
    job, run_dir, restart = killed_and_restarted(tmp_path, slurm_cluster, [])
    assert restart["detected_by"] == "agent" and restart["srun"] == 0, restart
    assert restart["srun_error"] == f"agent: rank 1 on {restart['node']} killed by SIGKILL", restart
    # the agents forked the second start themselves: one srun; each agent's lines in its own file
    agent = (run_dir / "slurm" / f"{job}_agent1_log.err").read_text()
    assert "agent node 1" in agent and "rank 1 killed by SIGKILL" in agent, agent[-2000:]
    assert "restarting the node's ranks from the warm agent (start 1 of the step)" in agent, agent[-2000:]
    batch = (run_dir / "slurm" / f"{job}_0_log.err").read_text()
    assert "inside job" not in batch, batch[-2000:]  # the step loop restarted nothing


def test_a_rank_killed_in_one_task_a_rank_mode_is_ended_by_srun(tmp_path, slurm_cluster):
    _, _, restart = killed_and_restarted(tmp_path, slurm_cluster, ["cluster.gpu_binding=task"])
    # srun's line: the task wrapper's status, 128 + 9 (slurm/task_wrapper.sh starts Python)
    assert restart["detected_by"] == "srun", restart
    assert restart["srun_error"].endswith(": task 1: Exited with exit code 137") and restart["exit_code"] == 137


# Each rank's heartbeat (its host) is written once a heartbeat interval (cluster.hang_timeout_s / 60:
# 1 s), the first one interval after its start: the steps last 4 s, so every rank has written one.
TP = ["+cluster=localslurm", "cluster.nodes=2", "+strategy=tp", "train.steps=4", "train.seq_len=32",
      "data.num_tokens=20000", "cluster.hang_timeout_s=60", "fault.step_delay_s=1.0"]


def test_a_cyclic_distribution_keeps_tensor_parallel_inside_a_node_or_is_refused(tmp_path, slurm_cluster):
    cyclic = "cluster.srun_args=['--distribution=cyclic']"
    proc = launcher(TP + ["cluster.gpu_binding=task", cyclic], cwd=tmp_path, env=slurm_cluster, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "submitted job" not in out, out
    assert "cluster.srun_args[0]='--distribution=cyclic': cyclic distribution numbers ranks across nodes" in out
    assert "--distribution=block" in out and not list(tmp_path.glob("runs/*/slurm/*_submitted.pkl"))
    runs = {}
    for name, extra in (("block", []), ("cyclic", [cyclic])):  # both in the queue at once
        (tmp_path / name).mkdir()
        runs[name] = submit_run(TP + extra, tmp_path / name, slurm_cluster)
    for name, (job, run_dir) in runs.items():
        wait_until(lambda: job_gone(job, slurm_cluster), 120, f"job {job} to leave the queue")
        assert read_run_json(run_dir)["status"] == "completed", name
        hosts = [json.loads((run_dir / "heartbeat" / f"rank{r}.json").read_text())["host"] for r in range(4)]
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3], (name, hosts)  # each TP pair on one node
        # each forked rank's CPUs: its share of its task's (the local cluster binds nothing: the
        # task has this machine's CPUs, split evenly between the node's two ranks)
        placed = [re.search(r"rank \d+: CPUs (\S+) \((.*)\)", (run_dir / "logs" / f"rank{r}.log").read_text())
                  for r in range(4)]
        assert all(m and "an even split of the task's" in m.group(2) for m in placed), placed
        if len(os.sched_getaffinity(0)) >= 2:  # one CPU: both ranks share it
            assert placed[0].group(1) != placed[1].group(1) and placed[2].group(1) != placed[3].group(1), placed
    block, cyclic_rows = (read_metrics(runs[n][1]) for n in ("block", "cyclic"))
    assert [r["loss"] for r in cyclic_rows] == [r["loss"] for r in block] and len(block) == 4
