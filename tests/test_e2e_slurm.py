"""Tier 4: the launcher against the real local Slurm cluster (sbatch, srun, sacct)."""
from __future__ import annotations

import subprocess
import time

import pytest

from conftest import ONE_STEP, final_states, launcher, run_dir_of, wait_until
from helpers import strategy_options
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def sacct_rows(job_ids, env):
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,NNodes,NodeList"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return {p[0]: p for p in (line.split("|") for line in out.splitlines()) if len(p) == 4}


def wait_terminal(job_ids, env, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = sacct_rows(job_ids, env)
        if len(rows) == len(job_ids) and all(r[1].split()[0] not in ("PENDING", "RUNNING", "REQUEUED",
                                                                       "COMPLETING") for r in rows.values()):
            return rows
        time.sleep(1)
    raise AssertionError(f"jobs {job_ids} not finished after {timeout} s: {sacct_rows(job_ids, env)}")


def test_two_nodes_two_tasks_each(tmp_path, slurm_cluster):
    proc = launcher(["+cluster=localslurm", "+strategy=ddp", "cluster.nodes=2", "cluster.gpus_per_node=2",
                     "train.steps=10", "launcher.wait=true"], cwd=tmp_path, env=slurm_cluster, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["world_size"] == 4 and info["nodes"] == 2
    assert len(set(info["hostnames"])) == 2 and all(h.startswith("node") for h in info["hostnames"])
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11)) and all(r["world_size"] == 4 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert {"tokens_per_s", "samples_per_s", "peak_mem_bytes", "mfu"} <= set(rows[0])
    job = info["job_id"]
    acct = sacct_rows([job], slurm_cluster)[job]
    assert acct[1] == "COMPLETED" and acct[2] == "2"
    for task in range(4):  # per-rank logs of srun and of the trainer
        assert (run_dir / "slurm" / f"{job}_{task}_log.out").exists()
        assert (run_dir / "logs" / f"rank{task}.log").exists()
    assert (run_dir / "sbatch.sh").read_text().count("#SBATCH --nodes=2") == 1
    assert (run_dir / "config.yaml").exists() and (run_dir / "git_commit.txt").exists()
    assert "steps: 10" in proc.stdout and f"run_dir: {run_dir}" in proc.stdout


# One strategy for each way a rank is built (test_torchrun's rule: every builder, ZeRO
# family, pipeline, tensor parallel and offload), each across 2 nodes; every strategy's
# training is tests/test_strategies.py's. Two ranks a node where the layout needs them
# (HSDP's shards inside a node, TP inside a node), else one: what crosses nodes is the same.
ACROSS_NODES = {"ddp": 1, "hsdp": 2, "zero1": 1, "zero3_offload": 1, "pp_fsdp_tp": 2}


def test_each_way_a_rank_is_built_runs_on_two_nodes(tmp_path, slurm_cluster):
    """Each builder path trains through the launcher on 2 nodes (two sweeps: 2 ranks a node
    where the layout needs them, else 1)."""
    from test_torchrun import _paths

    every = set().union(*(_paths(s) for s in strategy_options()))
    assert set().union(*(_paths(s) for s in ACROSS_NODES)) == every
    jobs, run_dirs = [], []
    for per_node in (1, 2):
        chosen = [s for s, n in ACROSS_NODES.items() if n == per_node]
        proc = launcher(["+cluster=localslurm", "+strategy=" + ",".join(chosen), "cluster.nodes=2",
                         f"cluster.gpus_per_node={per_node}", "train.steps=4", "train.seq_len=32",
                         "data.num_tokens=50000", f"data.cache_dir={tmp_path}/data", "-m"], cwd=tmp_path,
                        env=slurm_cluster, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        jobs += [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job")]
        run_dirs += [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("run_dir: ")]
    assert len(jobs) == len(run_dirs) == len(ACROSS_NODES), (jobs, run_dirs)
    states = wait_terminal(jobs, slurm_cluster, timeout=1500)
    for job, run_dir in zip(jobs, run_dirs):
        info = read_run_json(run_dir)
        where = f"{info.get('strategy')} ({run_dir}): {info.get('error')}"
        assert states[job][1] == "COMPLETED" and info["status"] == "completed", where
        assert info["world_size"] == 2 * ACROSS_NODES[info["strategy"]] and len(set(info["hostnames"])) == 2, where
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4], where
    assert sorted(read_run_json(d)["strategy"] for d in run_dirs) == sorted(ACROSS_NODES)


def test_sweep_submits_one_job_per_point_without_waiting(tmp_path, slurm_cluster):
    # a trivial user script (no torch): what is under test is the sweep, not training
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1,2", f"entrypoint={ONE_STEP}", "-m"], cwd=tmp_path,
                    env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job")]
    run_dirs = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("run_dir: ")]
    assert len(jobs) == 2 and len(set(run_dirs)) == 2
    rows = wait_terminal(jobs, slurm_cluster)
    assert sorted(rows[j][2] for j in jobs) == ["1", "2"]
    assert all(rows[j][1] == "COMPLETED" for j in jobs), rows
    assert all(read_run_json(d)["status"] == "completed" for d in run_dirs)


def test_rerun_of_a_completed_run_submits_nothing(tmp_path, slurm_cluster):
    args = ["+cluster=localslurm", "cluster.nodes=1", f"entrypoint={ONE_STEP}", "launcher.wait=true"]
    first = launcher(args, cwd=tmp_path, env=slurm_cluster, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    again = launcher(args, cwd=tmp_path, env=slurm_cluster, timeout=60)
    assert again.returncode == 0 and "already completed" in again.stdout
    assert "submitted job" not in again.stdout


def test_hostile_names_reach_the_job_quoted(tmp_path, slurm_cluster):
    run_dir = tmp_path / "it's a $(touch pwned); x"
    quoted = str(run_dir).replace("'", "\\'")  # Hydra's escape for a quote inside a quoted value
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1", f"entrypoint={ONE_STEP}", f"launcher.run_dir='{quoted}'",
                     "launcher.job_name='a b;$(touch pwned2)'", "+cluster.env.WEIRD='x \"y\" $(touch pwned3)'",
                     "launcher.wait=true"], cwd=tmp_path, env=slurm_cluster, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_run_json(run_dir)["status"] == "completed"
    assert not list(tmp_path.rglob("pwned*")) and not list(run_dir.rglob("pwned*"))
    job = read_run_json(run_dir)["job_id"]
    assert final_states(job, slurm_cluster)[-1] == "COMPLETED"

    # slurmdbd names a job whose record a step created "allocation" until the job's own
    # record arrives, sometimes after its end state (seen in a fresh-clone suite): wait for it
    def name():
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "JobName"], env=slurm_cluster,
                             capture_output=True, text=True).stdout.split("\n")[0]
        return out if out not in ("", "allocation") else None
    assert wait_until(name, 60, "sacct's name of the job past its placeholder") == "a b;$(touch pwned2)"


def test_hang_on_two_nodes_names_the_node(tmp_path, slurm_cluster):
    # cluster.in_job_restarts=0: the hang ends the run (restarted: tests/test_in_job_restart_slurm.py)
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=50",
                     "cluster.hang_timeout_s=5", "fault.hang_rank=1", "fault.hang_at_step=3", "cluster.in_job_restarts=0", "launcher.wait=true"],
                    cwd=tmp_path, env=slurm_cluster, timeout=300)
    assert proc.returncode != 0
    run_dir = run_dir_of(proc.stdout)
    import json

    report = json.loads((run_dir / "hang.json").read_text())
    hosts = read_run_json(run_dir)["hostnames"]  # one per node, in rank order (node2 or node4: the suite's pair)
    assert report["stuck_ranks"] == [1] and report["stuck_hosts"] == [hosts[1]], (report, hosts)
    assert read_run_json(run_dir)["failure"] == "hang"
