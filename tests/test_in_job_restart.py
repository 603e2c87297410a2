"""Restarts inside the job (cluster.in_job_restarts), without Slurm: the decision
(slurm.states.restart_refusal), the tasks' request and its record in run.json
(train.harness.restart, through train.harness.outcome.record_failure), and the batch
script's step loop, run by bash with a stand-in for srun (what the loop asks of Slurm:
tests/test_slurm_request.py)."""
from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import compose_run, run_step_loop, stuck_srun
from launcher.submit import render_script
from slurm.env import rendezvous_port, task_identity
from slurm.states import restart_refusal
from spec.identity import TaskIdentity
from spec.layout import build_layout
from slurm.submitit_adapter import STEP_LOOP
from spec.rundir import (RESTART, SEGMENT_FAILURE, SLURM_JOB, SLURM_REQUEST, Status, read_metrics, read_run_json,
                         update_run_json)
from train.harness.outcome import record_failure, record_hang
from train.harness.restart import Restart, note_first_row, note_start

ERROR = "RuntimeError: fault.raise_at_step=7: injected failure"


def entry(step=7, error=ERROR, job="41"):
    return {"job_id": job, "segment": 0, "error": error, "step": step}


@pytest.mark.parametrize("entries,failure,error,step,budget,started,why", [
    ([], None, ERROR, 7, 3, True, None),                                   # a rank's own error
    ([], "hang", "hang: no step completed", 9, 3, True, None),
    ([], "rank_failure", "RuntimeError: Connection closed by peer", 7, 3, True, None),
    ([entry()], None, ERROR, 9, 3, True, None),                           # another step: not a loop
    ([entry(job="40"), entry(job="40")], None, ERROR, 7, 2, True, None),  # an earlier job's restarts
    ([], None, ERROR, 7, 3, None, None),                                  # a user's code: steps unknown
    ([], None, ERROR, 7, 0, True, "cluster.in_job_restarts=0"),
    ([], "node_failure", ERROR, 7, 3, True, "failure node_failure is not restarted"),
    ([], "no_cuda", ERROR, 7, 3, True, "failure no_cuda is not restarted"),
    ([], None, "ModuleNotFoundError: No module named 'x'", 7, 3, True, "ModuleNotFoundError is an error of the start"),
    ([], None, ERROR, 1, 3, False, "failed before the run's first step"),
    ([entry(), entry(step=9)], None, ERROR, 11, 2, True, "restart budget spent: cluster.in_job_restarts=2"),
    ([entry()], None, ERROR, 7, 3, True, "crash loop: the same error at step 7"),
    ([], "rendezvous", "DistNetworkError: EADDRINUSE", 0, 3, None, None),  # the next srun's port differs
    ([entry(0, "DistNetworkError: port: 25041, EADDRINUSE")], "rendezvous", "DistNetworkError: port: 29140, EADDRINUSE",
     0, 3, None, "crash loop: the same error at step 0"),  # twice in a row: not the port's luck
])
def test_which_failures_are_restarted_inside_the_job(entries, failure, error, step, budget, started, why):
    got = restart_refusal(entries, failure, error, step, "41", budget, started)
    assert got == why if why is None else got.startswith(why)


def test_the_rendezvous_port_follows_the_restart_index():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242"}
    first = task_identity(env)
    assert first.in_job_restart is None and first.master_port == rendezvous_port("4242") == 25000 + 4242
    ports = [task_identity({**env, "STO_IN_JOB_RESTART": str(i)}).master_port for i in range(4)]
    assert ports[0] == first.master_port and len(set(ports)) == 4
    assert task_identity({**env, "STO_IN_JOB_RESTART": "2"}).in_job_restart == 2


class Beats:
    """A watchdog as the trainer leaves it: ``step`` steps begun, ``warm`` once one completed."""

    def __init__(self, step: int, warm: bool = True) -> None:
        self.step, self.warm, self.interval_s = step, warm, 0


def identity(rank: int, restart=0, job="41") -> TaskIdentity:
    return TaskIdentity(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank,
                        master_addr="node1", master_port=29541, job_id=job, restart_count=0, launcher="srun",
                        in_job_restart=restart)


def started_segment(run_dir: Path, segment: int) -> None:
    """run.json as rank 0's claim leaves it when a segment starts."""
    update_run_json(run_dir, status=Status.RUNNING, segments=segment + 1, **SEGMENT_FAILURE)


@pytest.fixture
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_ranks_error_is_restarted_once_and_its_peers_echo_changes_nothing(tmp_path, no_slurm):
    """Rank 1 raises at step 7 of segment 0: run.json names it (failed_rank, its node), the
    job restarts (in_job_restarts gets one entry, RUN_DIR/RESTART is written); rank 0's
    broken connection after it neither replaces the cause nor adds an entry."""
    log = logging.getLogger("test_in_job_restart")
    started_segment(tmp_path, 0)
    record_failure(RuntimeError("fault.raise_at_step=7: injected failure"), tmp_path, 1, 2, log, 0,
                   Restart(tmp_path, 3, identity(1), 0, Beats(6)))
    record_failure(RuntimeError("[gloo] Connection closed by peer"), tmp_path, 0, 2, log, 0,
                   Restart(tmp_path, 3, identity(0), 0, Beats(6)))
    info = read_run_json(tmp_path)
    assert info["status"] == "restarting" and info["error"] == ERROR and info["failed_rank"] == 1
    assert info["failure"] is None and info["in_job_restart"] == "restart 1 of 3 in job 41"
    [restart] = info["in_job_restarts"]
    assert {k: restart[k] for k in ("job_id", "segment", "reason", "error", "step", "rank")} == {
        "job_id": "41", "segment": 0, "reason": "error", "error": ERROR, "step": 7, "rank": 1}
    assert restart["node"] == info["failed_node"] and restart["failed_at"] > 0
    assert json.loads((tmp_path / RESTART).read_text()) == restart


def test_a_hang_that_every_rank_records_is_restarted_once(tmp_path):
    """Every rank's watchdog records the hang and asks: the first asks the restart (the
    stuck rank and its node in the entry), the later ones' records leave it restarting."""
    started_segment(tmp_path, 1)
    report = {"timeout_s": 10, "stuck_ranks": [1], "stuck_hosts": ["node2"]}
    for rank in (0, 1):
        record_hang(tmp_path, report)
        assert Restart(tmp_path, 3, identity(rank, restart=1), 1, Beats(8)).ask(print, 1, "node2")
    info = read_run_json(tmp_path)
    assert info["status"] == "restarting" and info["failure"] == "hang"
    [restart] = info["in_job_restarts"]
    assert (restart["reason"], restart["rank"], restart["node"], restart["step"]) == ("hang", 1, "node2", 9)


def test_the_same_error_at_the_same_step_ends_the_run(tmp_path, no_slurm):
    log = logging.getLogger("test_in_job_restart")
    for segment in (0, 1):
        started_segment(tmp_path, segment)
        (tmp_path / RESTART).unlink(missing_ok=True)  # the batch script's, before each srun
        record_failure(RuntimeError("fault.raise_at_step=8: injected failure"), tmp_path, 1, 2, log, 0,
                       Restart(tmp_path, 3, identity(1, restart=segment), segment, Beats(7)))
    info = read_run_json(tmp_path)
    assert len(info["in_job_restarts"]) == 1 and not (tmp_path / RESTART).exists()
    assert info["status"] == "failed" and info["in_job_restart"].startswith("not restarted: crash loop")


def test_no_restart_without_the_step_loop_or_before_the_first_step(tmp_path, no_slurm):
    log = logging.getLogger("test_in_job_restart")
    started_segment(tmp_path, 0)
    record_failure(RuntimeError("boom"), tmp_path, 0, 2, log, 0, Restart(tmp_path, 3, identity(0, None), 0, Beats(6)))
    assert "in_job_restarts" not in read_run_json(tmp_path) and read_run_json(tmp_path)["in_job_restart"] is None
    record_failure(RuntimeError("boom"), tmp_path, 0, 2, log, 0, Restart(tmp_path, 3, identity(0), 0, Beats(0, False)))
    info = read_run_json(tmp_path)
    assert info["in_job_restart"] == "not restarted: failed before the run's first step"
    assert not (tmp_path / RESTART).exists()


def test_a_restarted_segment_notes_when_it_started_and_the_seconds_lost(tmp_path):
    update_run_json(tmp_path, in_job_restarts=[dict(entry(), failed_at=100.0, restarted_at=None, seconds_lost=None)])
    rows = [{"step": 6, "segment": 0, "time": 90.0}, {"step": 7, "segment": 0, "time": 91.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    note_start(tmp_path, identity(0, restart=0))  # the job's first step: no restart to note
    assert read_run_json(tmp_path)["in_job_restarts"][0]["restarted_at"] is None
    note_start(tmp_path, identity(0, restart=1))
    note_first_row(tmp_path, identity(0, restart=1), {"step": 7, "segment": 1, "time": 130.5, "step_time_s": 1.5})
    [restart] = read_run_json(tmp_path)["in_job_restarts"]
    assert restart["restarted_at"] >= 100.0 and restart["downtime_s"] == round(restart["restarted_at"] - 100.0, 3)
    assert restart["seconds_lost"] == 39.0  # step 7 done at 130.5, due at 90 + 1.5 (step 6's time + a step)


# --- the batch script's step loop ---------------------------------------------------------

def test_a_failed_rendezvous_is_restarted_on_the_next_srun_and_its_loss_counted_once(tmp_path, no_slurm):
    """Rank 0 cannot bind the port in the restart after an error (srun 1), then joins in
    srun 2: two entries of segment 1 (told apart by ``srun``), both closed by the segment
    that starts; the seconds lost go to the error that began the chain, 0 to the rest."""
    from train.harness.outcome import rendezvous_failed

    log = logging.getLogger("test_in_job_restart")
    started_segment(tmp_path, 0)
    record_failure(RuntimeError("fault.raise_at_step=7: injected failure"), tmp_path, 1, 2, log, 0,
                   Restart(tmp_path, 3, identity(1, restart=0), 0, Beats(6)))
    (tmp_path / RESTART).unlink()  # the batch script's, before the next srun
    rendezvous_failed(RuntimeError("[gloo] Connection reset: EADDRINUSE"), tmp_path, identity(0, restart=1), 1, 3,
                      log)
    info = read_run_json(tmp_path)
    assert info["status"] == "restarting" and info["failure"] == "rendezvous" and info["failed_rank"] == 0
    assert [(e["segment"], e["srun"], e["reason"]) for e in info["in_job_restarts"]] == [(0, 0, "error"),
                                                                                          (1, 1, "rendezvous")]
    assert json.loads((tmp_path / RESTART).read_text())["srun"] == 1
    started_segment(tmp_path, 1)
    note_start(tmp_path, identity(0, restart=2))
    later = time.time() + 5  # no row of step 6 here: the time since the first failure
    note_first_row(tmp_path, identity(0, restart=2), {"step": 7, "segment": 1, "time": later, "step_time_s": 1.0})
    first, second = read_run_json(tmp_path)["in_job_restarts"]
    # downtimes are rounded to the ms: the two failures, recorded a moment apart here, may round alike
    assert first["restarted_at"] == second["restarted_at"] and first["failed_at"] <= second["failed_at"]
    assert first["downtime_s"] >= second["downtime_s"] >= 0
    assert first["seconds_lost"] > 0 and second["seconds_lost"] == 0.0


def test_a_failed_rendezvous_without_the_step_loop_ends_the_job(tmp_path, monkeypatch):
    """No restart to ask (no step loop): the job is cancelled, as its other tasks would wait
    in the rendezvous until train.dist_timeout_s."""
    from spec.rundir import SLURM_REQUEST
    from train.harness.outcome import is_rendezvous_error, rendezvous_failed
    import torch.distributed as dist

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    error = dist.DistNetworkError("The server socket has failed to listen: EADDRINUSE")
    assert is_rendezvous_error(error) and not is_rendezvous_error(ValueError("a bad value"))
    rendezvous_failed(error, tmp_path, identity(0, restart=None), 0, 3, logging.getLogger("test_in_job_restart"))
    info = read_run_json(tmp_path)
    assert (info["status"], info["failure"], info["failed_rank"]) == ("failed", "rendezvous", 0)
    assert "EADDRINUSE" in info["error"] and "in_job_restarts" not in info
    assert "action=cancel" in (tmp_path / SLURM_REQUEST).read_text()


FAKE_SRUN = """#!/bin/bash
# A stand-in for srun: notes the restart index and the folder, and fails with the request
# file left behind while $FAIL_TIMES says so.
echo "${STO_IN_JOB_RESTART:-unset} ${@: -1}" >> "$CALLS"
n=$(wc -l < "$CALLS")
if [ "$n" -le "$FAIL_TIMES" ]; then
  [ -n "$MARK" ] && echo '{"step": 7}' > "$MARK"
  exit 1
fi
exit 0
"""


def run_script(tmp_path: Path, overrides, fail_times: int, mark: bool = True, folder: Path | None = None):
    """The rendered batch script of a 2-node localslurm run, run by bash with srun and
    Slurm's client stood in for (tests/test_slurm_request.py: what they are asked):
    (exit status, the srun calls, stderr)."""
    cfg = compose_run(["+cluster=localslurm", *overrides])
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    script = render_script(cfg, build_layout(cfg), run_dir, python="python", wrapper="/w.sh")
    if folder is not None:  # a job array's element: its folder is SWEEP/.arrays/UID/%a -> RUN_DIR/slurm
        script = script.replace(f"'{run_dir}/slurm'", f"'{folder}/%a'")
    proc = run_step_loop(tmp_path, script, FAKE_SRUN, {"FAIL_TIMES": str(fail_times), "SLURM_ARRAY_TASK_ID": "3",
                                                        "MARK": str(run_dir / RESTART) if mark else ""})
    calls = (tmp_path / "calls").read_text().splitlines()
    return proc.returncode, calls, proc.stderr, run_dir


def test_the_step_runs_again_while_it_asks_and_restarts_are_left(tmp_path):
    code, calls, err, run_dir = run_script(tmp_path, ["cluster.in_job_restarts=3"], fail_times=2)
    assert code == 0 and [c.split()[0] for c in calls] == ["0", "1", "2"]
    assert calls[0].split(" ", 1)[1] == f"{run_dir}/slurm"
    assert "restart 1 of 3 inside job 41" in err and "restart 2 of 3" in err and '{"step": 7}' in err
    assert not (run_dir / RESTART).exists()


def test_the_loop_stops_at_the_budget_and_without_a_request(tmp_path):
    code, calls, _, run_dir = run_script(tmp_path / "a", ["cluster.in_job_restarts=2"], fail_times=9)
    assert code == 1 and [c.split()[0] for c in calls] == ["0", "1", "2"]
    assert (run_dir / RESTART).exists()  # the last request is left: nobody honoured it
    code, calls, _, _ = run_script(tmp_path / "b", ["cluster.in_job_restarts=2"], fail_times=1, mark=False)
    assert code == 1 and len(calls) == 1  # a failure the tasks did not ask to restart
    code, calls, _, _ = run_script(tmp_path / "c", ["cluster.in_job_restarts=0"], fail_times=1)
    assert code == 1 and calls == [f"unset {tmp_path / 'c' / 'run dir' / 'slurm'}"]  # no loop: the step once


def test_an_array_element_finds_the_request_in_its_own_run_directory(tmp_path):
    arrays = tmp_path / "sweep" / ".arrays" / "uid"
    arrays.mkdir(parents=True)
    os.symlink(tmp_path / "run dir" / "slurm", arrays / "3")  # element 3's folder, as submit_array links it
    code, calls, _, _ = run_script(tmp_path, [], fail_times=1, folder=arrays)
    assert code == 0 and [c.split()[0] for c in calls] == ["0", "1"]
    assert calls[0].split(" ", 1)[1] == f"{arrays}/%a"


def test_the_loop_runs_outside_a_batch_script_from_its_environment(tmp_path):
    """slurm/step_loop.sh sourced by a shell inside an allocation, without the batch script
    (no ``sto_slurm``: Slurm's client on the PATH) and its parameters exported: the step
    restarts as in a job; a missing parameter ends the shell at once, naming it."""
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    params = {"STO_RESTARTS": "2", "STO_GRACE_S": "5", "STO_PYTHON": "python", "STO_REQUEST": SLURM_REQUEST,
              "STO_RESTART": RESTART, "STO_FACTS": SLURM_JOB}
    script = f'. {shlex.quote(str(STEP_LOOP))}\nsrun --ntasks=2 python -m mine "$RUN_DIR/slurm"'
    proc = run_step_loop(tmp_path, script, FAKE_SRUN, {**params, "FAIL_TIMES": "1", "MARK": str(run_dir / RESTART),
                                                       "RUN_DIR": str(run_dir), "SLURM_JOB_PARTITION": "debug"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().splitlines() == [f"0 {run_dir}/slurm", f"1 {run_dir}/slurm"]
    assert "restart 1 of 2 inside job 41" in proc.stderr and (run_dir / SLURM_JOB).exists()
    assert "scontrol show job -o 41" in (tmp_path / "calls.slurm").read_text()
    params.pop("STO_REQUEST")
    gone = subprocess.run(["bash", "-c", f"{script}\necho survived"], env={**os.environ, **params},
                          capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0 and "survived" not in gone.stdout and "RUN_DIR/SLURM_REQUEST" in gone.stderr


def test_a_users_first_logged_row_of_a_restarted_segment_gives_the_seconds_lost(tmp_path):
    """train.session.log hands the segment's first row (rank 0) to the harness's hook once,
    which notes the restart's seconds_lost as the trainer's first row does."""
    from train import session
    from train.harness.preempt import PreemptionFlag

    update_run_json(tmp_path, in_job_restarts=[dict(entry(), failed_at=100.0, seconds_lost=None)])
    me = identity(0, restart=1)
    session._bind(session._State(tmp_path, 0, 2, 1, PreemptionFlag(),
                                 first_row=lambda row: note_first_row(tmp_path, me, row)))
    try:
        session.log(3, loss=1.0)
        assert read_run_json(tmp_path)["in_job_restarts"][0]["seconds_lost"] > 0  # no row of step 2: since the failure
        update_run_json(tmp_path, in_job_restarts=[dict(read_run_json(tmp_path)["in_job_restarts"][0],
                                                        seconds_lost=None)])
        session.log(4, loss=0.9)  # not the first row: nothing noted again
    finally:
        session._bind(None)
    assert read_run_json(tmp_path)["in_job_restarts"][0]["seconds_lost"] is None
    assert [r["step"] for r in read_metrics(tmp_path)] == [3, 4]


# A step whose first start asks a restart and never ends (a peer waiting in the rendezvous):
# the loop must end it after its grace and start the next.
STUCK_SRUN = stuck_srun('{"reason": "rendezvous"}\\n')


def test_a_task_that_outlives_the_restart_request_is_ended_after_the_grace(tmp_path):
    """hang_timeout_s=60: heartbeats every 1 s, a grace of 33 s (made 2 here: the script's
    bound is what is tested, not its size)."""
    from slurm.submitit_adapter import restart_grace_s

    assert restart_grace_s(1.0) == 33 and restart_grace_s(5.0) == 45 and restart_grace_s(0.0) == 30
    cfg = compose_run(["+cluster=localslurm", "cluster.hang_timeout_s=60", "cluster.gpu_binding=task"])  # no agents
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    script = render_script(cfg, build_layout(cfg), run_dir, python="python", wrapper="/w.sh")
    assert script.count('STO_GRACE_S=33 ') == 1  # the parameter of slurm/step_loop.sh
    script = script.replace('STO_GRACE_S=33 ', 'STO_GRACE_S=2 ')
    proc = run_step_loop(tmp_path, script, STUCK_SRUN, {"MARK": str(run_dir / RESTART)})
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()] == ["0", "1"]
    assert "a task still runs 2 s after the restart was asked: ending step" in proc.stderr
    assert "the step failed (exit 137" in proc.stderr and "restart 1 of 3 inside job 41" in proc.stderr



# --- a task that dies without a word: srun's --kill-on-bad-exit, then the step loop --------

KILLED = {"task": 3, "node": "node2", "signal": "SIGKILL", "exit_code": None,
          "line": "srun: error: node2: task 3: Killed"}


def beat(run_dir: Path, rank: int, step: int, at: float | None = None) -> None:
    """A rank's heartbeat as its watchdog writes it (train/harness/watchdog.py)."""
    (run_dir / "heartbeat").mkdir(exist_ok=True)
    (run_dir / "heartbeat" / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "step": step, "phase": "compute", "time": time.time() if at is None else at}))


def running(run_dir: Path, segment: int = 0) -> None:
    started_segment(run_dir, segment)
    update_run_json(run_dir, job_id="41", started_at=time.time() - 5)


def test_a_task_killed_without_a_word_is_recorded_from_srun_and_restarted(tmp_path):
    """Rank 3 SIGKILLed at step 6 (its peers killed by srun's --kill-on-bad-exit, nobody
    recorded anything): run.json gets rank_failure as srun named it, the entry names the
    task, its node and the signal, and RESTART is written; the same signal at the same step
    once more is a crash loop."""
    from train.harness.restart import after_srun

    running(tmp_path)
    beat(tmp_path, 0, 5)
    beat(tmp_path, 3, 4, at=time.time() - 3600)  # an earlier segment's beat: not this one's
    assert after_srun(tmp_path, 137, 0, 3, "41", KILLED, print)
    info = read_run_json(tmp_path)
    assert (info["status"], info["failure"], info["dead_ranks"], info["dead_hosts"]) == (
        "restarting", "rank_failure", [3], ["node2"])
    assert info["error"] == "srun: task 3 on node2 killed by SIGKILL and no task recorded a failure (srun exit 137)"
    [entry] = info["in_job_restarts"]
    assert {k: entry[k] for k in ("reason", "rank", "node", "signal", "exit_code", "srun_exit", "step", "srun")} == {
        "reason": "rank_failure", "rank": 3, "node": "node2", "signal": "SIGKILL", "exit_code": None,
        "srun_exit": 137, "step": 6, "srun": 0}
    assert entry["srun_error"] == KILLED["line"] and json.loads((tmp_path / RESTART).read_text()) == entry
    (tmp_path / RESTART).unlink()
    running(tmp_path, 1)
    beat(tmp_path, 0, 5)
    assert not after_srun(tmp_path, 137, 1, 3, "41", dict(KILLED, task=1, node="node1"), print)
    info = read_run_json(tmp_path)
    assert info["status"] == "failed" and info["in_job_restart"].startswith("not restarted: crash loop")
    assert not (tmp_path / RESTART).exists()


def test_an_unrecorded_failure_before_the_first_step_ends_the_run(tmp_path):
    from train.harness.restart import after_srun

    running(tmp_path)
    report = {"task": 0, "node": "node1", "signal": None, "exit_code": 1,
              "line": "srun: error: node1: task 0: Exited with exit code 1"}
    assert not after_srun(tmp_path, 1, 0, 3, "41", report, print)
    info = read_run_json(tmp_path)
    assert info["status"] == "failed" and "task 0 on node1 exited with code 1" in info["error"]
    assert info["in_job_restart"] == "not restarted: failed before the run's first step"
    running(tmp_path)  # a user's code that logged no step: unknown, restarted by the other rules
    (tmp_path / "entrypoint.json").write_text("{}")
    assert after_srun(tmp_path, 139, 0, 3, "41", None, print)
    [entry] = read_run_json(tmp_path)["in_job_restarts"]
    assert (entry["rank"], entry["node"], entry["signal"], entry["step"]) == (None, None, "SIGSEGV", 1)


def test_what_a_task_recorded_or_slurm_ended_is_left_to_them(tmp_path, no_slurm):
    """srun's report changes nothing a task decided (a refusal is in run.json), nor a step
    that Slurm ended (USR2 before the handler: the teardown requeues; SIGTERM: scancel);
    a failure a task recorded but was killed before deciding is decided with its record."""
    from train.harness.restart import after_srun

    running(tmp_path)
    beat(tmp_path, 0, 5)
    for code, report in ((0, None), (140, None), (143, None), (143, dict(KILLED, signal="SIGTERM"))):
        assert not after_srun(tmp_path, code, 0, 3, "41", report, print)
    assert read_run_json(tmp_path)["status"] == "running"
    update_run_json(tmp_path, status="failed", error=ERROR, failed_rank=1, failed_node="node1",
                    in_job_restart="not restarted: crash loop: ...")
    assert not after_srun(tmp_path, 137, 0, 3, "41", KILLED, print)
    update_run_json(tmp_path, in_job_restart=None)  # recorded, then killed by srun before it asked
    assert after_srun(tmp_path, 137, 0, 3, "41", KILLED, print)
    [entry] = read_run_json(tmp_path)["in_job_restarts"]
    assert (entry["reason"], entry["error"], entry["rank"], entry["node"], entry["signal"]) == (
        "error", ERROR, 1, "node1", "SIGKILL")


def test_a_users_code_that_took_sruns_sigterm_for_a_cancel_is_restarted(tmp_path):
    """srun's --kill-on-bad-exit ends a dead task's peers with SIGTERM, which a user's code
    takes for a scancel (rank 0 records ``interrupted``, ``terminated``): srun's report of
    a task that died first makes it the failure it was, and restarts it."""
    from train.harness.restart import after_srun

    running(tmp_path)
    beat(tmp_path, 0, 3)
    (tmp_path / "entrypoint.json").write_text("{}")
    update_run_json(tmp_path, status="interrupted", last_interruption="terminated")
    assert after_srun(tmp_path, 137, 0, 3, "41", KILLED, print)
    info = read_run_json(tmp_path)
    assert (info["status"], info["failure"], info["last_interruption"]) == ("restarting", "rank_failure", None)
    update_run_json(tmp_path, status="interrupted", last_interruption="terminated", in_job_restarts=[])
    assert not after_srun(tmp_path, 143, 1, 3, "41", None, print)  # a scancel's SIGTERM: srun named nobody first


SILENT_SRUN = """#!/bin/bash
# A stand-in for srun whose first step's task 1 is SIGKILLed on node2 (srun's lines on its
# stderr, the batch script's, as Slurm 22.05 prints them), its peers SIGTERMed for it; the
# next step ends well.
echo "${STO_IN_JOB_RESTART:-unset} $*" >> "$CALLS"
if [ "$(wc -l < "$CALLS")" -eq 1 ]; then
  echo "srun: error: node2: task 1: Killed" >&2
  echo "srun: launch/slurm: _step_signal: Terminating StepId=41.0" >&2
  echo "srun: error: node1: task 0: Terminated" >&2
  exit 143
fi
exit 0
"""


def test_the_loop_records_and_restarts_a_step_whose_task_died_without_a_word(tmp_path):
    """The rendered batch script with srun stood in for: a step that ended with 137 and no
    RESTART goes to `python -m train.harness.restart after-srun`, which reads srun's lines
    from the script's stderr (a file, as sbatch's --error gives it) and restarts."""
    import sys

    cfg = compose_run(["+cluster=localslurm", "launcher.snapshot=false", "cluster.gpu_binding=task"])  # srun's tasks
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    running(run_dir)
    beat(run_dir, 0, 5)
    script = render_script(cfg, build_layout(cfg), run_dir, python=shlex.quote(sys.executable), wrapper="/w.sh")
    log = tmp_path / "err"  # the batch script's stderr, an earlier segment's line in it already
    log.write_text("srun: error: node9: task 7: Killed\n")
    script = script.replace("#!/bin/bash\n", f"#!/bin/bash\nexec 2>>{shlex.quote(str(log))}\n", 1)
    proc = run_step_loop(tmp_path, script, SILENT_SRUN, {})
    err = log.read_text()
    assert proc.returncode == 0, err
    assert [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()] == ["0", "1"]
    assert "the step failed (exit 143" in err and "restart 1 of 3 inside job 41" in err
    [entry] = read_run_json(run_dir)["in_job_restarts"]
    assert (entry["rank"], entry["node"], entry["signal"], entry["step"]) == (1, "node2", "SIGKILL", 6)
