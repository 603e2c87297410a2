"""The per-node agent without Slurm (train/harness/agent.py): each rank's variables by
construction, and an agent forking real ranks in this process's environment of an srun
task, that records a rank killed without a word and restarts the node's ranks from its warm
state. The same on the local Slurm cluster: tests/test_kill_on_bad_exit_slurm.py,
tests/test_in_job_restart_slurm.py."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from slurm.env import task_identity
from spec.rundir import RESTART, read_run_json, update_run_json
from train.harness.agent import Agent, is_agent, rank_env, restart_of

# The agent of node 1 of a 2-node step, one srun task a node (srun numbered it task 1).
AGENT_ENV = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_CPUS_PER_TASK": "32",
             "STO_AGENT": "4", "STO_IN_JOB_RESTART": "0"}


def test_each_rank_is_numbered_by_construction_and_sees_one_task_a_rank():
    assert is_agent(AGENT_ENV) and not is_agent({**AGENT_ENV, "STO_AGENT_RANK": "1"})
    for local in range(4):
        env = {**AGENT_ENV, **rank_env(AGENT_ENV, local, 4, 2)}
        te = task_identity(env)
        assert (te.rank, te.local_rank, te.node_rank, te.world_size, te.local_world_size) == (4 + local, local, 1, 8, 4)
        assert te.order_error() is None and te.launcher == "srun" and te.in_job_restart == 2
        assert (te.master_addr, te.master_port) == ("gpu07", task_identity({**env, "STO_IN_JOB_RESTART": "2"}).master_port)
        assert (env["SLURM_PROCID"], env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (
            str(4 + local), str(4 + local), str(local), "1")
        assert (env["SLURM_NTASKS"], env["SLURM_TASKS_PER_NODE"], env["SLURM_CPUS_PER_TASK"]) == ("8", "4(x2)", "8")
    # whatever srun's distribution numbered the agent's task: its node decides
    assert rank_env({**AGENT_ENV, "SLURM_PROCID": "0"}, 0, 4, None)["RANK"] == "4"
    assert "STO_IN_JOB_RESTART" not in rank_env(AGENT_ENV, 0, 4, None)


def _rank(run_dir, first_try_kills):
    """A rank's entry (node 1's ranks 2 and 3): on its first start rank 3 kills itself, rank
    2 sleeps outside any collective; on the next start both end at once."""
    def entry() -> int:
        rank, marker = int(os.environ["RANK"]), run_dir / "killed"
        if os.environ["STO_IN_JOB_RESTART"] != "0" or not first_try_kills:
            (run_dir / f"start{os.environ['STO_IN_JOB_RESTART']}_rank{rank}").write_text(os.environ["SLURM_PROCID"])
            return 0
        if rank == 3:
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        return 0
    return entry


@pytest.mark.parametrize("budget", [1, 0])
def test_a_killed_rank_is_recorded_at_once_and_restarted_from_the_warm_agent(tmp_path, monkeypatch, budget):
    for key, value in AGENT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("STO_AGENT", "2")
    update_run_json(tmp_path, status="running", job_id="77", segments=1, started_at=time.time())
    (tmp_path / "heartbeat").mkdir()  # the run did steps: a restart is allowed
    (tmp_path / "heartbeat" / "rank2.json").write_text(json.dumps({"step": 3, "time": time.time()}))
    start = time.monotonic()
    code = Agent(str(tmp_path), _rank(tmp_path, True), 2, budget).run()
    took = time.monotonic() - start
    info = read_run_json(tmp_path)
    assert took < 30, took  # rank 2 would sleep 60 s: the agent stopped it
    if budget == 0:  # no restart left: the agent ends with the dead rank's status, the failure recorded
        assert code == 128 + signal.SIGKILL and info["status"] == "failed" and info["failure"] == "rank_failure"
        assert info["dead_ranks"] == [3] and "agent: rank 3 on" in info["error"] and "killed by SIGKILL" in info["error"]
        return
    assert code == 0
    [entry] = info["in_job_restarts"]
    assert (entry["rank"], entry["signal"], entry["detected_by"], entry["srun"], entry["step"]) == (
        3, "SIGKILL", "agent", 0, 4), entry
    assert entry["failed_at"] - float((tmp_path / "killed").read_text()) < 10
    assert restart_of(str(tmp_path))["srun"] == 0  # kept until srun ends: every agent reads it
    assert (tmp_path / f".{RESTART}.start1").exists()  # the start the agents began, for the step loop
    assert {p.name: p.read_text() for p in tmp_path.glob("start1_rank*")} == {"start1_rank2": "2", "start1_rank3": "3"}
    assert (tmp_path / "logs" / "rank3.out").exists()  # a rank's output: its own file


# A stand-in for srun under node agents: its agents restarted the ranks once inside it (start
# 1 marked, RESTART of start 0 left), then start 1 failed without a restart (refused): the
# loop must not take the old RESTART for a new request. With AGAIN set, start 1 asked one.
AGENTS_SRUN = """#!/bin/bash
echo "${STO_IN_JOB_RESTART:-unset} $*" >> "$CALLS"
if [ "$(wc -l < "$CALLS")" -eq 1 ]; then
  printf '{"srun": %s}\\n' "${AGAIN:-0}" > "$RUN/RESTART"
  touch "$RUN/.RESTART.start1"
  exit 137
fi
exit 0
"""


@pytest.mark.parametrize("again", [False, True])
def test_the_step_loop_follows_the_agents_last_start(tmp_path, again):
    import shlex
    import sys

    from helpers import compose_run, run_step_loop
    from launcher.submit import render_script
    from spec.layout import build_layout

    cfg = compose_run(["+cluster=localslurm", "launcher.snapshot=false"])
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = render_script(cfg, build_layout(cfg), run_dir, python=shlex.quote(sys.executable), wrapper="/w.sh")
    proc = run_step_loop(tmp_path, script, AGENTS_SRUN, {"RUN": str(run_dir), **({"AGAIN": "1"} if again else {})})
    calls = [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()]
    if again:  # start 1's own request: the next srun is start 2
        assert proc.returncode == 0 and calls == ["0", "2"], (calls, proc.stderr[-2000:])
        assert "restart 2 of 3 inside job 41" in proc.stderr
    else:  # start 0's request is done with: start 1's failure goes to after-srun, no new srun
        assert proc.returncode == 137 and calls == ["0"], (calls, proc.stderr[-2000:])
        assert not (run_dir / RESTART).exists()


def test_a_ranks_output_goes_to_submitits_file_for_its_rank(tmp_path):
    """Beside the agent's task's file (an array element's too: %A_%a_%t), else RUN_DIR/logs."""
    from train.harness.agent import log_paths

    mine = tmp_path / "191_0_1_log.out"
    mine.touch()
    assert log_paths(5, str(tmp_path), mine, "1") == (tmp_path / "191_0_5_log.out", tmp_path / "191_0_5_log.err")
    assert log_paths(5, str(tmp_path), None, "1") == (tmp_path / "logs" / "rank5.out", tmp_path / "logs" / "rank5.err")
    assert log_paths(1, str(tmp_path), mine, "1", agent=True) == (tmp_path / "191_0_agent1_log.out",
                                                                  tmp_path / "191_0_agent1_log.err")
    assert log_paths(1, str(tmp_path), None, "1", agent=True)[0] == tmp_path / "logs" / "agent1.out"


def test_the_warm_imports_leave_the_fork_safe_for_cuda(monkeypatch):
    """Before the imports the parent asks NVML, not the driver, whether CUDA is there
    (DeepSpeed's import asks; a driver asked before the fork leaves the ranks without CUDA);
    CUDA initialised by the imports is refused rather than left to fail in every rank."""
    import torch

    from train.harness.forked import NVML_CHECK, warm_for_fork

    monkeypatch.delenv(NVML_CHECK, raising=False)
    seen = []
    warm_for_fork("run", lambda run_dir: seen.append(os.environ.get(NVML_CHECK)))
    assert seen == ["1"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialised by the imports before the ranks are forked"):
        warm_for_fork("run", lambda run_dir: None)


def test_a_rank_ended_by_slurms_signal_is_no_failure_and_its_siblings_finish(tmp_path, monkeypatch):
    """scancel's SIGTERM reaches every rank: one that dies of it records nothing, and the
    agent leaves the others to end by themselves (their checkpoint first), not SIGKILLed."""
    for key, value in AGENT_ENV.items():
        monkeypatch.setenv(key, value)
    update_run_json(tmp_path, status="running", job_id="77", segments=1, started_at=time.time())

    def entry() -> int:
        if os.environ["RANK"] == "3":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.5)  # rank 2 saving after the signal
        (tmp_path / "rank2_finished").write_text("x")
        return 0

    assert Agent(str(tmp_path), entry, 2, 1).run() == 128 + signal.SIGTERM
    assert (tmp_path / "rank2_finished").exists() and read_run_json(tmp_path)["status"] == "running"


def test_the_spares_take_the_dropped_nodes_places_in_order():
    from train.harness.agent_places import places

    hosts = ["n1", "n2", "n3", "s1", "s2"]
    assert places(hosts, 3, []) == ["n1", "n2", "n3"]
    assert places(hosts, 3, ["n2"]) == ["n1", "s1", "n3"]  # the others keep their places
    assert places(hosts, 3, ["n2", "s1"]) == ["n1", "s2", "n3"]  # a dead spare is passed over
    assert places(hosts, 3, ["n2", "n3"]) == ["n1", "s1", "s2"]
    assert places(hosts, 3, ["n1", "n2", "n3"]) is None  # too few left: the step loop's
    assert places(hosts, 3, ["gone-before"]) == ["n1", "n2", "n3"]  # a node of an earlier srun


def test_a_ranks_step_is_its_places_when_the_srun_holds_spares():
    """The ranks see the training nodes in place order as their step: node 3 of the srun in
    place 0 hosts rank 0 and the master; the world is the places', not the srun's."""
    env = {**AGENT_ENV, "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "gpu[07-09]"}
    placed = (0, ["gpu09", "gpu08"])
    for local in range(4):
        te = task_identity({**env, **rank_env(env, local, 4, 1, placed)})
        assert (te.rank, te.node_rank, te.world_size, te.master_addr) == (local, 0, 8, "gpu09"), te
        assert te.order_error() is None
    other = task_identity({**env, **rank_env(env, 1, 4, 1, (1, ["gpu09", "gpu08"]))})
    assert (other.rank, other.node_rank, other.master_addr) == (5, 1, "gpu09")


def test_a_spares_agent_stands_by_warm_and_forks_in_the_dropped_nodes_place(tmp_path, monkeypatch):
    """The agent of node gpu09, a spare of a 2-node step (the srun holds 3, STO_AGENT_PLACES=2):
    no ranks until a restart of start 0 drops gpu08; then its ranks in place 1 for start 1
    (RANK 2, 3), and it ends once every placed node's agent has (their end marks)."""
    from train.harness.agent_places import AGENTS_DIR, mark

    env = {**AGENT_ENV, "SLURM_PROCID": "2", "SLURM_NODEID": "2", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_NODES": "3",
           "SLURM_STEP_NODELIST": "gpu[07-09]", "STO_AGENT_PLACES": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def entry() -> int:
        rank = os.environ["RANK"]
        (tmp_path / f"start{os.environ['STO_IN_JOB_RESTART']}_rank{rank}").write_text(os.environ["MASTER_ADDR"])
        mark(str(tmp_path), "gpu07", "end", "0")  # the run ends: gpu07's agent, the other place, ended
        return 0

    agent = Agent(str(tmp_path), entry, 2, 3)
    assert (tmp_path / AGENTS_DIR / "gpu09.up").exists() and agent.places == ["gpu07", "gpu08"]
    import threading
    threading.Timer(0.5, lambda: (tmp_path / RESTART).write_text('{"srun": 0, "reason": "node_failure"}\nexclude=gpu08\n')).start()
    assert agent.run() == 0
    assert agent.places == ["gpu07", "gpu09"]
    assert {p.name: p.read_text() for p in tmp_path.glob("start*_rank*")} == {"start1_rank2": "gpu07",
                                                                               "start1_rank3": "gpu07"}
    assert (tmp_path / f".{RESTART}.start1").exists() and (tmp_path / AGENTS_DIR / "gpu09.end").read_text() == "0"
