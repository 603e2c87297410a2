"""Stacks on demand: ``touch RUN_DIR/STACK_NOW`` or
``python -m launcher.stacks RUN_DIR`` makes every rank write its threads' stacks and go on.
On the local Slurm cluster: tests/test_preemption.py's cancelled 2-node run is asked first."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from conftest import launcher, run_dir_of, wait_until
from launcher.track import stacks
from spec.rundir import STACK_NOW, read_metrics, read_run_json
from train.harness.watchdog import Watchdog


def nap_in_a_named_frame(stop: threading.Event) -> None:
    stop.wait(30)


def test_a_touch_makes_the_rank_write_every_threads_stack_and_go_on(tmp_path):
    (tmp_path / STACK_NOW).touch()  # left by an earlier segment: not a request to this one
    old = time.time_ns() - 10**9
    os.utime(tmp_path / STACK_NOW, ns=(old, old))
    stop = threading.Event()
    worker = threading.Thread(target=nap_in_a_named_frame, args=(stop,), name="worker")
    worker.start()
    dog = Watchdog(tmp_path, rank=3, node=1, host="h", world_size=4, timeout_s=0, interval_s=0).start()
    try:
        time.sleep(0.8)
        assert not (tmp_path / "stacks").exists()
        dog.phase("compute", 7)
        (tmp_path / STACK_NOW).touch()
        path = tmp_path / "stacks" / "rank3.txt"
        wait_until(path.exists, 5, "rank 3's stacks")
        text = path.read_text()
        header = json.loads(text.splitlines()[0])
        assert (header["rank"], header["node"], header["host"], header["step"], header["phase"]) == (3, 1, "h", 7,
                                                                                                  "compute")
        assert header["request_ns"] == os.stat(tmp_path / STACK_NOW).st_mtime_ns and header["pid"] == os.getpid()
        threads = [line for line in text.splitlines() if line.startswith("Thread ")]
        assert threads[0].startswith("Thread MainThread") and any(t.startswith("Thread worker") for t in threads)
        assert "in nap_in_a_named_frame" in text and "in test_a_touch_makes_the_rank" in text
        where = stacks.innermost(path)  # the main thread waits in conftest's wait_until
        assert where.startswith("conftest.py:") and where.endswith(" in wait_until"), where
        first = header["request_ns"]
        time.sleep(0.05)
        (tmp_path / STACK_NOW).touch()  # a second request gets a second answer
        wait_until(lambda: json.loads(path.read_text().splitlines()[0])["request_ns"] > first, 5, "the second answer")
        assert dog._thread.is_alive()  # and the rank goes on
    finally:
        stop.set()
        dog.stop()
        worker.join()


def test_a_rank_that_starts_after_the_request_is_asked_again(tmp_path, capsys):
    """A rank's watchdog takes a STACK_NOW older than its own start for a previous segment's:
    one that starts after launcher.stacks touched the file (a late rank under load) answers
    the touch launcher.stacks repeats every RETOUCH_S while an answer is missing."""
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", "world_size": 2}))
    early = Watchdog(tmp_path, rank=0, node=0, host="h", world_size=2, timeout_s=0, interval_s=0).start()
    late: list = []
    starter = threading.Timer(0.3, lambda: late.append(
        Watchdog(tmp_path, rank=1, node=0, host="h", world_size=2, timeout_s=0, interval_s=0).start()))
    starter.start()
    try:
        code = stacks.main([str(tmp_path), "--timeout", "10"])
    finally:
        starter.join()
        for dog in [early, *late]:
            dog.stop()
    out = capsys.readouterr().out
    assert code == 0 and "stacks of 2/2 ranks" in out, out


def test_launcher_stacks_refuses_what_is_not_a_running_run(tmp_path, capsys):
    assert stacks.main([str(tmp_path)]) == 2
    assert "has no run.json" in capsys.readouterr().err
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", "world_size": 2}))
    assert stacks.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not running (status completed)" in err
    assert not (tmp_path / STACK_NOW).exists()  # nothing left behind
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", "world_size": 2}))
    assert stacks.main([str(tmp_path), "--timeout", "0"]) == 2
    assert "--timeout=0.0 must be > 0" in capsys.readouterr().err


def test_every_rank_of_a_running_local_run_answers(tmp_path, capsys):
    """A real 2-rank run: launcher.stacks names both ranks and the run still completes."""
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("proc", launcher(
        ["train.steps=8", "fault.step_delay_s=0.5", "cluster.gpus_per_node=2"], cwd=tmp_path)))
    run.start()
    runs = tmp_path / "runs"
    run_dir = wait_until(lambda: next((d for d in runs.glob("*") if read_metrics(d)), None) if runs.exists() else None,
                         120, "the run's first step")
    assert read_run_json(run_dir)["status"] == "running"
    code = stacks.main([str(run_dir), "--timeout", "20"])
    out = capsys.readouterr().out
    run.join(180)
    proc = result["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert code == 0 and "rank 0 (" in out and "rank 1 (" in out and "stacks of 2/2 ranks" in out, out
    assert run_dir_of(proc.stdout) == run_dir and read_run_json(run_dir)["status"] == "completed"
    assert len(read_metrics(run_dir)) == 8


def test_a_users_script_answers_too(tmp_path, capsys):
    """A user's entry point (no torch) runs the same watchdog thread: its frame is named.
    Its ranks nap until the test has their stacks (a file ends the nap; at most 120 s), so
    a rank that starts late under load is still napping when asked."""
    nap = Path(__file__).parent / "fixtures" / "nap.py"
    line = next(n for n, text in enumerate(nap.read_text().splitlines(), 1) if "time.sleep" in text)
    woken = tmp_path / "wake"
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("proc", launcher(
        [f"entrypoint={nap}", f"entrypoint_args=[120,{woken}]", "cluster.gpus_per_node=2"], cwd=tmp_path)))
    run.start()
    runs = tmp_path / "runs"
    try:
        run_dir = wait_until(lambda: next((d for d in runs.glob("*") if read_run_json(d).get("status") == "running"),
                                          None) if runs.exists() else None, 60, "the script's ranks")
        code = stacks.main([str(run_dir), "--timeout", "30"])
    finally:
        woken.touch()
        run.join(120)
    out = capsys.readouterr().out
    assert result["proc"].returncode == 0, result["proc"].stdout + result["proc"].stderr
    assert code == 0 and out.count(f"nap.py:{line} in <module>") == 2, out
