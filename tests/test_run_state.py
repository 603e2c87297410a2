"""The one place that decides a run's state (slurm/states.py), without Slurm: the outcome
``launcher.status`` and ``launcher.report`` print from run.json and Slurm's view of the
job, the end of a wait, a local run's exit, whether a segment may start; and no other
module keeps its own set of Slurm's state words."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slurm import states
from slurm.states import Decision, Outcome, decide
from spec.rundir import Status

REPO = Path(__file__).resolve().parent.parent


def run(status: str | None = None, **fields) -> dict:
    return {"status": status, **fields} if status is not None else dict(fields)


@pytest.mark.parametrize("queued,outcome", [("PENDING", Outcome.PENDING), ("REQUEUE_HOLD", Outcome.PENDING),
                                            ("RUNNING", Outcome.RUNNING), ("COMPLETING", Outcome.RUNNING)])
def test_a_queued_job_is_pending_or_running_whatever_run_json_says(queued, outcome):
    for status in (None, "completed", "failed", "requeued"):
        got = decide(run(status), queued=queued, accounted="FAILED", slurm_job=True)
        assert got == Decision(outcome, queued)


def test_sacct_that_still_sees_the_job_active_counts_as_queued():
    """sacct lags the controller: a job gone from squeue may still read RUNNING there."""
    assert decide(run("running"), accounted="RUNNING", slurm_job=True) == Decision(Outcome.RUNNING, "RUNNING")
    assert decide(run("requeued"), accounted="REQUEUED", slurm_job=True).outcome is Outcome.RUNNING
    assert decide(run("requeued"), accounted="PENDING", slurm_job=True).outcome is Outcome.PENDING


@pytest.mark.parametrize("accounted,status,outcome,shown", [
    ("COMPLETED", "completed", Outcome.COMPLETED, "COMPLETED"),
    ("COMPLETED", "failed", Outcome.FAILED, "COMPLETED"),       # the script exited 0, the run failed
    ("COMPLETED", "requeued", Outcome.FAILED, "COMPLETED"),
    ("FAILED", "completed", Outcome.FAILED, "FAILED"),          # both must say so
    ("CANCELLED by 1000", "running", Outcome.FAILED, "CANCELLED"),
    ("TIMEOUT", None, Outcome.FAILED, "TIMEOUT"),
    ("PREEMPTED", "requeued", Outcome.FAILED, "PREEMPTED"),
])
def test_an_ended_job_completed_only_when_slurm_and_run_json_both_say_so(accounted, status, outcome, shown):
    assert decide(run(status), accounted=accounted, slurm_job=True) == Decision(outcome, shown)


@pytest.mark.parametrize("status,outcome", [("completed", Outcome.COMPLETED), ("failed", Outcome.FAILED),
                                            ("stopped", Outcome.FAILED), ("interrupted", Outcome.FAILED),
                                            ("running", Outcome.UNKNOWN), ("starting", Outcome.UNKNOWN),
                                            (None, Outcome.UNKNOWN), ("from-a-newer-version", Outcome.UNKNOWN)])
def test_without_slurm_run_json_decides(status, outcome):
    shown = status.upper() if status else "UNKNOWN"
    local = decide(run(status, job_id="local"), slurm_job=False)
    unreachable = decide(run(status), slurm_job=True, slurm_ok=False)
    assert local == unreachable == Decision(outcome, shown)


def test_a_reused_job_id_is_not_ours_and_an_undecided_run_counts_as_failed():
    assert decide(run("completed"), slurm_job=True, trust_slurm=False) == Decision(Outcome.COMPLETED, "COMPLETED")
    assert decide(run("running"), slurm_job=True, trust_slurm=False) == Decision(Outcome.FAILED, "RUNNING")


def test_a_job_slurm_has_lost_is_decided_by_run_json_and_said_so():
    assert decide(run("completed"), slurm_job=True) == Decision(Outcome.COMPLETED, "COMPLETED", lost=True)
    assert decide(run("running"), slurm_job=True) == Decision(Outcome.FAILED, "RUNNING", lost=True)


def test_a_skipped_point_is_skipped():
    assert decide(run("completed"), skipped=True, queued="RUNNING") == Decision(Outcome.SKIPPED, "SKIPPED")


def test_outcomes_print_the_words_users_read():
    assert [str(o) for o in Outcome] == ["pending", "running", "completed", "failed", "skipped", "unknown"]
    assert f"{Outcome.FAILED}" == "failed" and Outcome.FAILED == "failed"
    assert [o.value for o in Outcome if o.finished] == ["completed", "failed", "skipped"]


def test_a_wait_ends_on_a_final_state_and_not_on_a_preemption():
    assert all(states.job_over(s) for s in states.TERMINAL)
    assert states.job_over("CANCELLED by 1000")
    assert not any(states.job_over(s) for s in ("PREEMPTED", "PENDING", "RUNNING", "REQUEUED", "", None))
    assert not states.ACTIVE & states.TERMINAL and states.PENDING <= states.ACTIVE


def test_succeeded_needs_run_json_and_the_job_or_the_local_ranks():
    assert states.succeeded(Status.COMPLETED)
    assert states.succeeded(Status.COMPLETED, slurm_state="COMPLETED")
    assert not states.succeeded(Status.COMPLETED, slurm_state="FAILED")
    assert not states.succeeded(Status.COMPLETED, exit_code=1)
    assert not states.succeeded(Status.FAILED, slurm_state="COMPLETED")
    assert not states.succeeded(None)


@pytest.mark.parametrize("status,code,recorded", [
    (Status.COMPLETED, 0, None), (Status.RUNNING, 0, None), (Status.FAILED, 1, None), (Status.INTERRUPTED, 143, None),
    (Status.RUNNING, 1, Status.FAILED), (Status.STARTING, -9, Status.FAILED), (None, 1, Status.FAILED),
    (Status.COMPLETED, 1, Status.FAILED),
])
def test_a_local_runs_exit_marks_it_failed_only_when_the_harness_did_not_say_why(status, code, recorded):
    assert states.after_local_exit(status, code) is recorded


def test_the_status_questions_take_an_unknown_status():
    assert [s.value for s in Status if states.final(s)] == ["completed", "stopped"]
    assert [s.value for s in Status if states.ended(s)] == ["completed", "failed", "stopped"]
    assert [s.value for s in Status if states.failed(s)] == ["failed"]
    assert [s.value for s in Status if states.requeued(s)] == ["requeued"]
    assert not any(f(None) for f in (states.final, states.ended, states.failed, states.requeued))


def _state_words() -> set:
    return set(states.ACTIVE | states.TERMINAL | set(states.FAILURE_OF_STATE))


def _collections_of_states(path: Path) -> list:
    """Literal sets, tuples, lists and dict keys naming two or more of Slurm's job states."""
    words, found = _state_words(), []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Set, ast.Tuple, ast.List, ast.Dict)) or not items:
            continue
        named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in words}
        if len(named) >= 2:
            where = path.relative_to(REPO) if REPO in path.parents else path
            found.append(f"{where}:{node.lineno} {sorted(named)}")
    return found


def test_slurm_states_holds_the_only_sets_of_slurm_states(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('TERMINAL = ("COMPLETED", "FAILED")\n')
    assert _collections_of_states(probe), "the scan sees a set of states"
    found = [hit for room in ("launcher", "slurm", "spec", "train") for path in sorted((REPO / room).rglob("*.py"))
             if path != REPO / "slurm" / "states.py" for hit in _collections_of_states(path)]
    assert not found, "Slurm states belong in slurm/states.py:\n" + "\n".join(found)


def test_a_local_run_is_running_while_its_ranks_write():
    info = {"status": "running", "job_id": "local"}
    decide, Outcome = states.decide, states.Outcome
    assert decide(info, alive=True) == (Outcome.RUNNING, "RUNNING", False)
    assert decide(info).outcome is Outcome.UNKNOWN  # silent: a killed launcher leaves "running"
    assert decide({"status": "completed"}, alive=True).outcome is Outcome.COMPLETED
    assert decide(info, slurm_job=True, alive=True).outcome is Outcome.FAILED  # a Slurm job: the queue decides
