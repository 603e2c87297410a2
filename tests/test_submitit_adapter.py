"""What slurm/submitit_adapter.py expects of submitit's private API, pinned: when a
submitit upgrade moves or changes these, this test fails, not a user's job."""
from __future__ import annotations

import inspect
import pickle
from pathlib import Path

from helpers import compose_run
from launcher.submit import TASK, slurm_parameters, task_call
from slurm import submitit_adapter
from slurm.submitit_adapter import TaskCall
from spec.layout import build_layout


def test_private_functions_exist_with_the_arguments_we_pass():
    from submitit.slurm import slurm

    params = inspect.signature(slurm._make_sbatch_string).parameters
    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=2", "cluster.mem_gb=64", "cluster.partition=gpu"])
    for name in ["command", "folder", *slurm_parameters(cfg, build_layout(cfg))]:
        assert name in params, f"submitit's _make_sbatch_string lost the parameter {name!r}"
    assert slurm._convert_mem(64) == "64GB" and slurm._convert_mem(0.5) == "512MB"  # our mem is in GB


def test_rendered_script_is_a_submitit_batch_script(tmp_path):
    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=2", "cluster.signal_delay_s=90"])
    script = submitit_adapter.render(slurm_parameters(cfg, build_layout(cfg)), tmp_path / "slurm")
    assert script.startswith("#!/bin/bash")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --signal=USR2@90" in script
    assert "#SBATCH --requeue" in script and "-m submitit.core._submit" in script


def test_array_element_pickle_loads_as_submitit_loads_it(tmp_path):
    from submitit.core.utils import DelayedSubmission

    path = tmp_path / "0_submitted.pkl"
    submitit_adapter.dump_delayed(task_call(tmp_path / "run"), path, time_min=30, max_requeues=3)
    loaded = DelayedSubmission.load(path)
    assert isinstance(loaded.function, TaskCall)
    assert loaded.function.target == TASK and loaded.function.args == (str(tmp_path / "run"),)
    assert loaded._timeout_min == 30 and loaded._timeout_countdown == 3


def test_task_call_imports_its_target_when_called():
    call = TaskCall("os.path:join", ("a", "b"))
    assert call() == "a/b"
    assert pickle.loads(pickle.dumps(call)) == call
    module, name = TASK.split(":")
    assert Path(__file__).resolve().parent.parent.joinpath(*module.split(".")).with_suffix(".py").is_file()


def test_memory_is_given_in_gb_as_submitit_expects(tmp_path):
    """cluster.mem_gb reaches sbatch as --mem=64GB (it crashed in submitit's conversion
    when passed as the string "64GB")."""
    cfg = compose_run(["+cluster=a100x8", "cluster.mem_gb=64"])
    script = submitit_adapter.render(slurm_parameters(cfg, build_layout(cfg)), tmp_path / "slurm")
    assert "#SBATCH --mem=64GB" in script


def test_a_task_call_is_checkpointable_as_itself():
    """submitit requeues a signalled job whose callable has ``checkpoint`` (else, for a job
    of 10 minutes or less, it ends it: 'timed-out and not checkpointable')."""
    from submitit.core.utils import DelayedSubmission

    call = TaskCall(TASK, ("/runs/x",))
    again = call.checkpoint()
    assert isinstance(again, DelayedSubmission) and again.function == call


def test_batch_script_requeues_a_step_killed_by_the_warning_signal(tmp_path):
    cfg = compose_run(["+cluster=a100x8", "cluster.max_requeues=7"])
    script = submitit_adapter.render(slurm_parameters(cfg, build_layout(cfg)), tmp_path / "slurm")
    tail = script[script.index("# teardown"):]
    assert script.index("-m submitit.core._submit") < script.index("# teardown")
    assert '[ "$code" -eq 140 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt 7 ]' in tail
    assert 'sto_slurm scontrol requeue "$sto_job"' in tail and tail.rstrip().endswith("exit $code")


def test_memory_policy_spelling():
    """null: no --mem (the site's default); 0: --mem=0, sbatch(1)'s 'special case [that]
    grants the job access to all of the memory on each node' (submitit's own spelling would
    be "0GB", which sbatch reads as 0 too: seen with `sbatch --test-only --mem=0GB`); N: N GB."""
    from submitit.slurm import slurm

    assert submitit_adapter.mem_option(None) is None and submitit_adapter.mem_option(0) == "0"
    assert submitit_adapter.mem_option(64) == slurm._convert_mem(64) == "64GB" and slurm._convert_mem(0) == "0GB"
    assert "mem" not in slurm_parameters(*_with(["+cluster=localslurm"]))
    assert slurm_parameters(*_with(["+cluster=h100x8"]))["mem"] == "0"


def test_no_submitit_wckey_in_the_real_submission(tmp_path):
    """submitit writes --wckey=submitit unless told wckey=None, which its executor accepts
    and keeps (a site with TrackWCKey refuses an unknown wckey); a site's own stays possible."""
    import shutil

    import pytest
    import submitit

    if shutil.which("srun") is None:
        pytest.skip("submitit's SlurmExecutor needs srun on PATH")
    for extra, expect in (([], None), (["+cluster.sbatch_extra.wckey=ours"], "#SBATCH --wckey=ours")):
        executor = submitit.SlurmExecutor(folder=tmp_path / "slurm", python=submitit_adapter.task_python())
        executor.update_parameters(**slurm_parameters(*_with(["+cluster=a100x8", *extra])))
        script = executor._make_submission_file_text(executor._submitit_command_str, "uid")
        wckeys = [line for line in script.splitlines() if line.startswith("#SBATCH --wckey")]
        assert wckeys == ([expect] if expect else [])


def _with(overrides):
    cfg = compose_run(overrides)
    return cfg, build_layout(cfg)


def test_a_job_queued_before_its_entry_point_moved_still_finds_it():
    """A job pickled with the old target (train.harness.job:main, before train/job.py) and
    requeued after the checkout is updated runs the entry point where it is now."""
    import train.job

    old = pickle.loads(pickle.dumps(TaskCall("train.harness.job:main", ("run_dir",))))
    assert old.function() is train.job.main
    assert TaskCall(TASK).function() is train.job.main


def test_the_step_loop_kills_srun_and_its_children_without_pkill(tmp_path):
    """``sto_kill_srun`` (slurm/step_loop.sh's, before a requeue) finds the subshell's children
    in /proc: a batch host without procps' pkill still kills the step's srun."""
    import shlex
    import subprocess
    import time

    script = (f". {shlex.quote(str(submitit_adapter.STEP_LOOP))}\n(sleep 300; true) & pid=$!\nsleep 0.3\n"
              "kids=$(cat /proc/$pid/task/*/children)\nsto_kill_srun $pid; wait $pid 2>/dev/null; echo \"$kids\"")
    bin_dir = tmp_path / "bin"  # bash, cat and sleep, but no pkill or pgrep
    bin_dir.mkdir()
    for tool in ("cat", "sleep"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    loop_env = {"STO_PYTHON": "python", "STO_REQUEST": "SLURM_REQUEST", "STO_RESTART": "RESTART",
                "STO_FACTS": "slurm_job.txt"}  # the loop's parameters, as a batch script sets them
    out = subprocess.run(["/bin/bash", "-c", script], env={"PATH": str(bin_dir), **loop_env}, capture_output=True,
                         text=True, timeout=30)
    (sleeper,) = out.stdout.split()
    time.sleep(0.1)
    state = Path(f"/proc/{sleeper}/stat")
    assert not state.exists() or state.read_text().split(") ")[1].startswith("Z"), out.stderr
