"""What a job's tasks ask of Slurm through the batch script (slurm/request.py), without a
cluster: the request file, the facts the batch script leaves for the tasks (time limit,
room for an exclusion), a failed Slurm call written back to run.json, and the rendered
batch script run by bash with srun and Slurm's client stood in for: each request done
(requeue while the step still runs, the exclusion's hold-update-release, cancel), the
client found although cluster.env's PATH hides it from the tasks. On the cluster, with
the tasks' client replaced by failing stubs: tests/test_slurm_client_hidden.py."""
from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from warm import pythonpath

from helpers import compose_run
from launcher.submit import render_script
from slurm import request
from spec.layout import build_layout
from spec.rundir import SLURM_JOB, SLURM_REQUEST, read_run_json, update_run_json

REPO = Path(__file__).resolve().parent.parent


def test_a_request_is_three_lines_the_batch_script_reads(tmp_path):
    path = request.ask(tmp_path, "exclude", "node failure\non node2", ["node3", "node2"])
    assert path == tmp_path / SLURM_REQUEST
    assert path.read_text() == "action=exclude\nexclude=node2,node3\nreason=node failure on node2\n"
    assert request.read_request(path) == {"action": "exclude", "exclude": "node2,node3",
                                          "reason": "node failure on node2"}
    request.ask(tmp_path, "requeue", "timeout")  # a later request of the step replaces it
    assert request.read_request(path) == {"action": "requeue", "exclude": "", "reason": "timeout"}
    with pytest.raises(ValueError, match="unknown request"):
        request.ask(tmp_path, "reboot", "")
    with pytest.raises(ValueError, match="not a node list"):
        request.ask(tmp_path, "exclude", "", ["node1; rm -rf /"])


def test_the_time_left_comes_from_slurm_or_the_batch_script(tmp_path):
    assert request.job_facts(tmp_path) is None and request.seconds_left(tmp_path, env={}) is None
    (tmp_path / SLURM_JOB).write_text("JobId=41 JobName=sto-x Partition=debug NumNodes=2 Features=pair1 "
                                      "EndTime=1000 WorkDir=/a b\nnode1|idle|pair1\nnode2|down*|pair1\n")
    facts = request.job_facts(tmp_path)
    assert facts.fields["Partition"] == "debug" and facts.usable == {"node1": "pair1"}
    assert request.seconds_left(tmp_path, env={}, now=940.0) == 60.0
    assert request.seconds_left(tmp_path, env={"SLURM_JOB_END_TIME": "1100"}, now=940.0) == 160.0
    (tmp_path / SLURM_JOB).write_text("JobId=41 EndTime=Unknown\n")  # no limit
    assert request.seconds_left(tmp_path, env={}) is None


def test_a_failed_slurm_call_is_written_back_to_run_json(tmp_path):
    update_run_json(tmp_path, status="requeued", preemptions=1)
    assert request.main(["failed", str(tmp_path), "requeue", "scontrol requeue:", "Job", "is", "gone"]) == 0
    info = read_run_json(tmp_path)
    assert info["status"] == "interrupted" and info["requeue_error"] == "scontrol requeue: Job is gone"
    update_run_json(tmp_path, status="requeued")
    request.main(["failed", str(tmp_path), "requeuehold", "denied"])
    info = read_run_json(tmp_path)
    assert info["status"] == "failed" and info["auto_requeue"] == "requeue failed: denied"
    update_run_json(tmp_path, status="requeued")
    request.main(["failed", str(tmp_path), "update", "no such node"])
    info = read_run_json(tmp_path)
    assert info["status"] == "requeued" and info["requeue_error"] == "requeued without the exclusion: no such node"
    assert request.main(["nonsense"]) == 2


# --- the rendered batch script, run by bash --------------------------------------------------

CLIENT = """#!/bin/bash
# A stand-in for Slurm's client: notes the call; `scontrol show job` and `sinfo` answer.
name=$(basename "$0")
echo "$name $*" >> "$LOG"
[ "$1" = "$FAIL" ] && { echo "$name $1: refused" >&2; exit 1; }
case "$name $1" in
  "scontrol show") echo "JobId=41 Partition=debug NumNodes=2 Features=(null) EndTime=$SLURM_TIME_FORMAT" ;;
  "sinfo -h") printf 'node1|idle|f\\nnode2|idle|f\\n' ;;
esac
exit 0
"""

SRUN = """#!/bin/bash
# A stand-in for srun: leaves $ASK as the step's request, then waits until the log shows
# $WAIT_FOR (the request done while the step runs) or ends at once with $EXIT.
echo "srun PATH=$PATH" >> "$LOG"
[ -n "$ASK" ] && printf "$ASK" > "$RUN_DIR/SLURM_REQUEST"
if [ -n "$WAIT_FOR" ]; then
  for _ in $(seq 300); do
    grep -q "$WAIT_FOR" "$LOG" && { echo "srun saw $WAIT_FOR" >> "$LOG"; exit 0; }
    sleep 0.1
  done
  echo "srun gave up" >> "$LOG"
fi
exit "${EXIT:-0}"
"""


def run_script(tmp_path: Path, overrides=(), array: bool = False, **env):
    """The rendered batch script of a localslurm run, run by bash with srun and Slurm's
    client stood in for: (exit status, the calls logged, stderr, run directory)."""
    cfg = compose_run(["+cluster=localslurm", *overrides])
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    update_run_json(run_dir, status="requeued")
    script = render_script(cfg, build_layout(cfg), run_dir, python=shlex.quote(sys.executable), wrapper="/w.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "sinfo", "scancel"):
        (bin_dir / name).write_text(SRUN if name == "srun" else CLIENT)
        (bin_dir / name).chmod(stat.S_IRWXU)
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"), "RUN_DIR": str(run_dir),
            "SLURM_JOB_ID": "41", "SLURM_JOB_PARTITION": "debug", "PYTHONPATH": pythonpath(), **env}
    if array:
        full.update(SLURM_ARRAY_JOB_ID="40", SLURM_ARRAY_TASK_ID="3")
    proc = subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True, timeout=60)
    return proc.returncode, (tmp_path / "log").read_text().splitlines(), proc.stderr, run_dir


def test_a_requeue_is_done_while_the_step_still_runs_and_its_srun_ended_first(tmp_path):
    """The fake srun waits until it sees the requeue: the script must not wait for it, and
    it kills srun before the requeue (a late srun would cancel the requeued job's step)."""
    code, calls, err, run_dir = run_script(tmp_path, ASK="action=requeue\\nexclude=\\nreason=preemption\\n",
                                           WAIT_FOR="scontrol requeue")
    assert code == 0, err
    assert calls[:2] == ["scontrol show job -o 41", "sinfo -h -N -p debug -o %N|%t|%f"]
    assert calls[2].startswith("srun ") and calls[3:] == ["scontrol requeue 41"]  # srun never saw it: gone before
    assert "the step asks: requeue job 41 (preemption)" in err
    assert not (run_dir / SLURM_REQUEST).exists()
    # the facts for the tasks: EndTime in epoch seconds (SLURM_TIME_FORMAT=%s), the partition's nodes
    assert request.job_facts(run_dir).fields["EndTime"] == "%s"
    assert request.job_facts(run_dir).usable == {"node1": "f", "node2": "f"}


def test_an_exclusion_is_hold_update_release_after_a_failed_step(tmp_path):
    code, calls, err, _ = run_script(tmp_path, array=True, EXIT="1",
                                     ASK="action=exclude\\nexclude=node2,node3\\nreason=node failure on node2\\n")
    assert code == 0, err  # requeued: not the step's failure
    assert calls[-3:] == ["scontrol requeuehold 40_3", "scontrol update JobId=40_3 ExcNodeList=node2,node3",
                          "scontrol release 40_3"]


def test_a_refused_requeue_is_written_back_and_the_step_ends_as_it_does(tmp_path):
    code, calls, err, run_dir = run_script(tmp_path, EXIT="1", FAIL="requeuehold",
                                           ASK="action=exclude\\nexclude=node2\\nreason=hardware fault on node2\\n")
    assert code == 1 and calls[-1] == "scontrol requeuehold 41"  # no update, no release
    info = read_run_json(run_dir)
    assert info["status"] == "failed" and info["auto_requeue"] == "requeue failed: scontrol requeuehold: refused"
    assert "job 41: scontrol requeuehold failed" in err


def test_a_cancel_and_the_client_hidden_from_the_tasks(tmp_path):
    """cluster.env's PATH (the tasks', e.g. a container's) lacks the client: the batch
    script still finds it, on the PATH it had before cluster.env."""
    code, calls, err, _ = run_script(tmp_path, ["+cluster.env.PATH=/usr/bin:/bin"], EXIT="1",
                                     ASK="action=cancel\\nexclude=\\nreason=a task refused to start\\n")
    assert code == 0, err
    assert "srun PATH=/usr/bin:/bin" in calls and calls[-1] == "scancel 41"


@pytest.mark.parametrize("left,kind", [(40, "timeout"), (3600, "preemption")])
def test_rank_0_asks_for_the_requeue_after_the_checkpoint(tmp_path, monkeypatch, left, kind):
    """A signal with at most signal_delay_s + 60 s left by the batch script's end time is a
    timeout; either way run.json says requeued first, then the request is left."""
    import logging
    import time

    from spec.config import RunConfig
    from train.harness.outcome import after_interruption
    from train.harness.preempt import PreemptionFlag

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    (tmp_path / SLURM_JOB).write_text(f"JobId=41 EndTime={int(time.time()) + left}\n")
    cfg = RunConfig()
    cfg.cluster.signal_delay_s = 30
    flag = PreemptionFlag()
    flag.agreed_requeue = True
    after_interruption(cfg, tmp_path, {}, logging.getLogger("test_slurm_request"), flag)
    info = read_run_json(tmp_path)
    assert info["status"] == "requeued" and info["last_interruption"] == kind and info[f"{kind}s"] == 1
    assert request.read_request(tmp_path / SLURM_REQUEST) == {"action": "requeue", "exclude": "", "reason": kind}
