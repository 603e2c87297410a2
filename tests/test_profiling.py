"""The profiler (train/profiling.py): torch.profiler over profile.steps,
profile.every and RUN_DIR/PROFILE_NOW windows on profile.ranks, Chrome traces in
RUN_DIR/profile/step_<START>/rank<R>.json.gz, the out-of-memory dump of profile.memory=true.

One real 2-rank run of the built-in trainer answers most of it: its [2,3] window, a
PROFILE_NOW touched while it runs, and the injected OOM that ends it. The CUDA allocator's
snapshots are exercised only by the gpu-marked test (skipped here: no CUDA)."""
from __future__ import annotations

import gzip
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

import warm
from conftest import launcher, run_dir_of, wait_until
from slurm.env import LOCAL_LAUNCH_ENV
from spec.config import ProfileConfig, RunConfig
from spec.rundir import PROFILE, PROFILE_NOW, read_metrics, read_run_json
from spec.validate import validate
from train import session
from train.profiling import StepProfiler, next_window, profiled_ranks, step_numbers

FIXTURES = Path(__file__).parent / "fixtures"


def steps_in(path: Path) -> list:
    """The N of every ProfilerStep#N of a gzipped Chrome trace, sorted, without repeats."""
    with gzip.open(path, "rt") as f:
        return sorted(set(step_numbers(json.load(f))))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 ranks, 14 steps of 0.3 s: profile.steps=[2,3] (default ranks: rank 0 only), a
    PROFILE_NOW touched once step 4 is done (2-step windows), and every rank out of memory at step 14."""
    work = tmp_path_factory.mktemp("profiled")
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("proc", launcher(
        ["cluster.gpus_per_node=2", "train.steps=14", "profile.steps=[2,3]", "profile.active=2", "profile.memory=true",
         "fault.step_delay_s=0.3", "fault.oom_at_step=14"], cwd=work)))
    run.start()
    runs = work / "runs"
    run_dir = wait_until(lambda: next((d for d in runs.glob("*") if len(read_metrics(d)) >= 4), None)
                         if runs.exists() else None, 120, "the run's step 4")
    done_at_touch = len(read_metrics(run_dir))
    (run_dir / PROFILE_NOW).touch()
    run.join(180)
    proc = result["proc"]
    assert run_dir_of(proc.stdout) == run_dir
    return proc, run_dir, done_at_touch


def test_a_window_of_steps_is_traced_on_local_rank_0_only(trained):
    proc, run_dir, _ = trained
    trace = run_dir / PROFILE / "step_2" / "rank0.json.gz"
    assert steps_in(trace) == [2, 3], steps_in(trace)
    assert not (run_dir / PROFILE / "step_2" / "rank1.json.gz").exists()  # default: local rank 0 of each node
    assert not list(run_dir.glob(f"{PROFILE}/*/rank1*")) and not list(run_dir.glob(f"{PROFILE}/**/*.tmp*"))
    assert "profile: steps 2-3 on rank 0: profile/step_2/rank0.json.gz" in proc.stdout


def test_profile_now_traces_the_steps_after_rank_0_saw_it(trained):
    proc, run_dir, done_at_touch = trained
    seen = re.findall(r"profile: PROFILE_NOW seen at step (\d+): profiling steps (\d+)-(\d+)", proc.stdout)
    assert len(seen) == 1, proc.stdout  # answered once: rank 0 removed the file when the window opened
    at, first, last = map(int, seen[0])
    assert done_at_touch <= at <= done_at_touch + 4 and (first, last) == (at + 1, at + 2) and last < 14
    assert steps_in(run_dir / PROFILE / f"step_{first}" / "rank0.json.gz") == [first, last]
    assert sorted(p.name for p in (run_dir / PROFILE).glob("step_*")) == sorted(["step_2", f"step_{first}"])
    assert not (run_dir / PROFILE_NOW).exists()


def test_an_oom_writes_each_ranks_dump_and_fails_the_run(trained):
    proc, run_dir, _ = trained
    assert proc.returncode != 0 and "status: failed" in proc.stdout
    info = read_run_json(run_dir)
    assert info["status"] == "failed" and info["error"].startswith("OutOfMemoryError: CUDA out of memory"), info
    for rank in (0, 1):  # profile.memory=true: every rank records; on CPU the JSON says there is no snapshot
        dump = json.loads((run_dir / PROFILE / f"oom_rank{rank}.json").read_text())
        assert (dump["rank"], dump["step"], dump["cuda"], dump["snapshot"]) == (rank, 14, False, None)
        assert "OutOfMemoryError" in dump["error"] and "no CUDA" in dump["why"] and dump["where"] == "at step 14"
    assert len(read_metrics(run_dir)) == 13


def test_an_oom_while_building_is_dumped_too(tmp_path):
    """The profiler exists before the model is built (on CUDA its allocator history covers the
    build): an out-of-memory error there is dumped as one in a step is."""
    proc = launcher(["cluster.gpus_per_node=1", "train.steps=2", "profile.memory=true", "fault.oom_in_build=true"],
                    cwd=tmp_path)
    assert proc.returncode != 0 and "status: failed" in proc.stdout, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    dump = json.loads((run_dir / PROFILE / "oom_rank0.json").read_text())
    assert (dump["where"], dump["step"], dump["rank"]) == ("while building the model or loading its checkpoint", 0, 0), dump
    assert "fault.oom_in_build" in dump["error"] and read_metrics(run_dir) == []
    assert "profile: out of memory while building the model or loading its checkpoint" in (run_dir / "logs" / "rank0.log").read_text()


def test_a_users_loop_is_profiled_on_the_ranks_asked(tmp_path):
    """Also when rank 1 reads run.json only after rank 0 ended the run (the script has no
    collectives: under load rank 0 can finish first, and rank 1 said "nothing to do" and
    wrote no trace): the local launch's token in run.json tells it the end is its own
    launch's. Here rank 1 of the same launch runs again after the run completed."""
    proc = launcher([f"entrypoint={FIXTURES / 'profiled.py'}", "entrypoint_args=[4]", "cluster.gpus_per_node=2",
                     "profile.steps=[2,3]", "profile.ranks=[1]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    folder = run_dir / PROFILE / "step_2"
    assert sorted(p.name for p in folder.iterdir()) == ["rank1.json.gz"]
    assert steps_in(folder / "rank1.json.gz") == [2, 3]
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["segments"] == 1 and info["local_launch"], info
    shutil.rmtree(folder)
    late = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", LOCAL_LAUNCH_ENV: info["local_launch"]}
    proc = warm.run_module("train", [str(run_dir)], cwd=tmp_path, env=late)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert steps_in(folder / "rank1.json.gz") == [2, 3]
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert log.count("segment 1: script") == 2 and "nothing to do" not in log, log  # rank 0's count, both times
    assert read_run_json(run_dir)["status"] == "completed"


def test_windows_ranks_and_requests_without_a_profiler(tmp_path):
    """The schedule alone (rank 0 profiles nothing here: profile.ranks=[1]): no torch
    profiler starts, yet rank 0 opens the requested window and removes the file."""
    cfg = ProfileConfig(steps=[5, 6], every=10, active=2, ranks=[1])
    assert [next_window(cfg, s) for s in (1, 6, 7, 11, 12, 25)] == [(5, 6), (6, 6), (10, 11), (11, 11), (20, 21),
                                                                     (30, 31)]
    assert next_window(ProfileConfig(), 1) is None
    assert profiled_ranks(ProfileConfig(), 16, 8) == (0, 8) and profiled_ranks(cfg, 16, 8) == (1,)
    lines = []
    prof = StepProfiler(cfg, tmp_path, rank=0, world_size=2, gpus_per_node=2, log=lines.append)
    assert not prof.mine and not prof.asked()  # nothing there: one stat
    (tmp_path / PROFILE_NOW).touch()
    assert not prof.asked()  # looked less than POLL_S ago
    prof._next_look = 0
    assert prof.asked()
    prof.before(3)
    prof.after(3, asked=True)
    assert prof.window == (4, 5) and (tmp_path / PROFILE_NOW).exists()
    prof.before(4)
    assert not (tmp_path / PROFILE_NOW).exists() and prof._prof is None
    prof.after(4, asked=True)  # a request while a window runs waits for its end
    assert prof.window == (4, 5)
    prof.before(5)
    prof.after(5)
    assert prof.window == (6, 6)  # the configured windows go on after it: what is left of [5,6]
    assert lines == ["profile: PROFILE_NOW seen at step 3: profiling steps 4-5"]
    prof.close()


def test_outside_a_run_profiled_step_does_nothing():
    assert session._state is None
    with session.profiled_step():
        pass


@pytest.mark.parametrize("key,value,expect", [
    ("steps", [3], "profile.steps=[3] must be [START, END], two optimizer steps"),
    ("steps", [0, 3], "profile.steps=[0, 3] starts at 0, but steps count from 1"),
    ("steps", [5, 3], "profile.steps=[5, 3]: START 5 is after END 3; write profile.steps=[3,5]"),
    ("every", -1, "profile.every=-1 must be >= 0"),
    ("active", 0, "profile.active=0 must be >= 1"),
    ("active", 5, "profile.active=5 exceeds profile.every=4: its windows would overlap"),
    ("ranks", [0, 2], "profile.ranks=[0, 2] names rank 2, outside the job's 2 (cluster.nodes=1 x "
                      "cluster.gpus_per_node=2); list ranks from 0 to 1"),
    ("ranks", [], "profile.ranks=[] names no rank of the job's 2"),
])
def test_bad_profile_settings_are_one_line_with_the_fix(key, value, expect):
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = 2
    cfg.profile.every = 4 if key == "active" and value == 5 else cfg.profile.every
    setattr(cfg.profile, key, value)
    with pytest.raises(ValueError) as info:
        validate(cfg)
    assert str(info.value).startswith(expect) and "\n" not in str(info.value), str(info.value)


@pytest.mark.gpu
def test_on_cuda_the_trace_has_kernels_and_memory_snapshots_are_written(tmp_path):
    """The CUDA side: kernels in the trace, the allocator's snapshot beside it, and a real
    out-of-memory error's snapshot (profile.memory=true)."""
    import pickle

    import torch

    cfg = ProfileConfig(steps=[1, 2], memory=True)
    prof = StepProfiler(cfg, tmp_path, rank=0, world_size=1, gpus_per_node=1, device="cuda")
    assert prof.history
    x = torch.randn(1024, 1024, device="cuda")
    for step in (1, 2, 3):
        prof.before(step)
        (x @ x).sum().item()
        prof.after(step)
    folder = tmp_path / PROFILE / "step_1"
    assert steps_in(folder / "rank0.json.gz") == [1, 2]
    with gzip.open(folder / "rank0.json.gz", "rt") as f:
        assert any(e.get("cat") == "kernel" for e in json.load(f)["traceEvents"])
    assert "segments" in pickle.loads((folder / "rank0_memory.pickle").read_bytes())
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
    except torch.OutOfMemoryError as exc:
        prof.oom(exc)
    assert "segments" in pickle.loads((tmp_path / PROFILE / "oom_rank0.pickle").read_bytes())
    assert json.loads((tmp_path / PROFILE / "oom_rank0.json").read_text())["snapshot"] == "oom_rank0.pickle"
    prof.close()
    from train.torch_compat import stop_memory_history

    stop_memory_history()
