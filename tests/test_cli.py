"""The launcher's command line: one-line errors (exit 2, nothing submitted), dry run."""
from __future__ import annotations

import pytest

from conftest import launcher, run_dir_of


@pytest.mark.parametrize("args,expect", [
    (["cluster=a100x8"], "append it with +cluster=a100x8"),
    (["+cluster=nope"], "unknown cluster 'nope'"),
    (["+strategy=zero9"], "unknown strategy 'zero9'"),
    (["train.foo=1"], "unknown field 'train.foo'"),
    (["+cluster=local", "cluster.nodes=0"], "cluster.nodes=0 must be >= 1"),
    (["cluster.nodes=1,2"], "add -m"),
    (["+cluster=a100x8", "strategy.tensor_parallel=16"], "TP must stay inside one node"),
    (["+cluster=a100x8", "cluster.nodes=2", "strategy.dp_replicate=3"], "world 16 != "),
    (["+cluster=a100x8", "cluster.slurm_conf=/nonexistent/slurm.conf"], "no such file"),
    # the planner's gate: 70B with DDP needs > 1 TB per 80 GB GPU
    (["+cluster=a100x8", "+model=llama3_70b"], "cluster.gpu_mem_gb=80: llama3_70b with strategy ddp is predicted"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, expect):
    proc = launcher(args, cwd=tmp_path, cold=True)  # a fresh interpreter: nothing else on stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], proc.stderr
    assert "submitted job" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, empty or not


def test_a_sweep_refused_whole_leaves_no_directory(tmp_path):
    (tmp_path / "runs" / "multirun" / "older").mkdir(parents=True)  # another sweep's: kept
    proc = launcher(["+cluster=a100x8", "strategy.tensor_parallel=16,32", "-m"], cwd=tmp_path)
    assert proc.returncode == 2 and "every point was skipped (2)" in proc.stderr, proc.stdout + proc.stderr
    assert [p.name for p in (tmp_path / "runs" / "multirun").iterdir()] == ["older"]
    (tmp_path / "runs" / "multirun" / "older").rmdir()
    (tmp_path / "runs" / "multirun").rmdir()
    proc = launcher(["+cluster=a100x8", "strategy.tensor_parallel=16", "-m"], cwd=tmp_path)
    assert proc.returncode == 2 and list((tmp_path / "runs").iterdir()) == []


def test_missing_local_cluster_names_the_fix(tmp_path):
    proc = launcher(["+cluster=localslurm"], cwd=tmp_path, env={"LOCALSLURM_DIR": str(tmp_path / "none")})
    assert proc.returncode == 2
    assert "make cluster-up" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_dry_run_prints_script_and_rank_map(tmp_path):
    proc = launcher(["+cluster=h100x8", "cluster.nodes=2", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "#SBATCH --nodes=2" in out and "submitit.core._submit" in out
    assert "world 16 = 2 nodes x 8/node" in out and "dry run: nothing submitted" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 16 and rows[9][:3] == ["9", "1", "1"]  # rank 9 -> node 1, local rank 1
    run_dir = run_dir_of(out)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "sbatch.sh").is_file()
    assert not (run_dir / "run.json").exists()


def test_dry_run_prints_mesh_coordinates(tmp_path):
    """3D: every rank's node, local rank and (pp, dp, tp); TP pairs inside a node, the
    two pipeline stages on the two nodes."""
    proc = launcher(["+cluster=h100x8", "+strategy=pp_fsdp_tp", "cluster.nodes=2", "launcher.dry_run=true"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "world 16 = 2 nodes x 8/node = pp 2 x dp_replicate 1 x dp_shard 4 x tp 2" in proc.stdout
    rows = [list(map(int, line.split())) for line in proc.stdout.splitlines()
            if line.strip() and line.split()[0].isdigit() and len(line.split()) == 8]
    assert len(rows) == 16
    for rank, node, local, pp, dp, _rep, _shard, tp in rows:
        assert (node, local) == divmod(rank, 8) and pp == node and tp == rank % 2 and dp == (rank % 8) // 2


def test_user_command_with_plus_prefixes_composes(tmp_path):
    # the users' command (llama3_8b so the ZeRO-3 choice matters: DDP would not fit)
    proc = launcher(["+cluster=a100x8", "+strategy=zero3", "+model=llama3_8b", "-m", "launcher.dry_run=true"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --gpus-per-node=8" in proc.stdout and "dry run: nothing submitted" in proc.stdout


def test_same_command_same_run_dir(tmp_path):
    a = run_dir_of(launcher(["+cluster=a100x8", "launcher.dry_run=true"], cwd=tmp_path).stdout)
    b = run_dir_of(launcher(["launcher.dry_run=true", "+cluster=a100x8"], cwd=tmp_path).stdout)
    c = run_dir_of(launcher(["+cluster=h100x8", "launcher.dry_run=true"], cwd=tmp_path).stdout)
    assert a == b != c


def test_planner_gate_can_be_overridden_and_sweeps_skip_what_does_not_fit(tmp_path):
    forced = launcher(["+cluster=a100x8", "+model=llama3_70b", "launcher.allow_oom=true", "launcher.dry_run=true",
                       "cluster.signal_delay_s=300"], cwd=tmp_path)  # 847 GB from one node: ~222 s to save
    assert forced.returncode == 0 and "dry run: nothing submitted" in forced.stdout, forced.stderr
    sweep = launcher(["+cluster=a100x8", "+model=llama3_8b", "+strategy=ddp,zero3", "launcher.dry_run=true", "-m"],
                     cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    skipped = [line for line in (sweep.stdout + sweep.stderr).splitlines() if line.startswith("skipped point")]
    assert len(skipped) == 1 and "+strategy=ddp" in skipped[0] and "predicted to need" in skipped[0], sweep.stderr
    assert sweep.stdout.count("dry run: nothing submitted") == 1 and "1 skipped" in sweep.stderr
    none = launcher(["+cluster=a100x8", "+model=llama3_70b", "+strategy=ddp,zero1", "launcher.dry_run=true", "-m"],
                    cwd=tmp_path)
    assert none.returncode == 2 and "every point was skipped (2)" in none.stderr, none.stdout + none.stderr


@pytest.mark.parametrize("status", ["submitted", "running", "requeued", "interrupted", "starting"])
def test_rerun_never_doubles_a_queued_run(tmp_path, status):
    """Re-running the command of a run whose job is still queued (pending its next segment
    after a requeue included) submits nothing; a job that left the queue is started again."""
    from helpers import compose_run
    from launcher.checks import already_done
    from spec.rundir import update_run_json

    cfg = compose_run(["+cluster=localslurm"])
    update_run_json(tmp_path, status=status, job_id="123")
    assert already_done(cfg, tmp_path, None, queued={"123": "PENDING"}) == "already in the queue as job 123"
    assert already_done(cfg, tmp_path, None, queued={"456": "RUNNING"}) is None
    for ended in ("failed", "stopped"):  # ended runs restart even while the job is still completing
        update_run_json(tmp_path, status=ended)
        assert already_done(cfg, tmp_path, None, queued={"123": "COMPLETING"}) is None
    update_run_json(tmp_path, status="completed")
    assert already_done(cfg, tmp_path, None, queued={}) == "already completed"


@pytest.mark.parametrize("time_min,delay,warned", [(1, 30, True), (2, 60, True), (2, 30, False), (10, 120, False)])
def test_a_signal_that_may_come_during_start_up_is_warned_of(tmp_path, time_min, delay, warned):
    """Slurm may send --signal's warning up to 60 s early: when signal_delay_s + 60 s reaches
    the time limit, the launch still goes ahead but says so, naming both fields."""
    proc = launcher(["+cluster=h100x8", f"cluster.time_min={time_min}", f"cluster.signal_delay_s={delay}",
                     "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    if warned:
        assert len(lines) == 1, proc.stderr
        assert f"cluster.signal_delay_s={delay}" in lines[0] and f"cluster.time_min={time_min}" in lines[0]
    else:
        assert not lines, proc.stderr


def test_waiting_polls_slurm_less_often_as_the_wait_grows():
    from launcher.submit import poll_interval

    assert [poll_interval(t, 1.0, 30.0) for t in (0, 5, 20, 100, 3600)] == [1.0, 1.0, 2.0, 10.0, 30.0]
