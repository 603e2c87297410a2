"""Tier 1: the rendered sbatch script (golden file) and its agreement with submitit."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.submit import render_script, slurm_parameters
from slurm import submitit_adapter
from helpers import compose_run as _compose
from spec.validate import validate
from spec.layout import build_layout

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/scratch/runs/demo run")   # a space: every path must be quoted
WRAPPER = "/opt/sto/slurm/task_wrapper.sh"  # where the project lies differs between checkouts


def _a100_two_nodes():
    return _compose(["+cluster=a100x8", "cluster.nodes=2", "+model=llama3_8b", "+strategy=ddp",
                     "+cluster.env.NCCL_DEBUG=WARN", "cluster.setup=[module load cuda/12.4]"])


def test_golden_a100x8_two_nodes():
    cfg = _a100_two_nodes()
    script = render_script(cfg, build_layout(cfg), RUN_DIR, python="/opt/venv/bin/python", wrapper=WRAPPER)
    golden = GOLDEN / "a100x8_2nodes.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --signal=USR2@120" in script


# Spaces, both quotes and a command substitution: each must stay literal in the script.
HOSTILE_RUN_DIR = Path("/scratch/runs/it's a \"quoted\" $(touch x) dir")
HOSTILE_JOB_NAME = "it's a $(touch x); `touch y` && \"z\""


def test_golden_hostile_run_dir_job_name_and_env():
    cfg = _a100_two_nodes()
    cfg.launcher.job_name = HOSTILE_JOB_NAME
    cfg.cluster.env["WEIRD"] = "a 'b' \"c\" $(touch x); `y`"
    validate(cfg)  # accepted: none of it is a control character, a backslash or a %
    script = render_script(cfg, build_layout(cfg), HOSTILE_RUN_DIR, python="/opt/venv/bin/python",
                           wrapper=WRAPPER)
    golden = GOLDEN / "a100x8_2nodes_hostile.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    folder = f"{HOSTILE_RUN_DIR}/slurm"
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert srun[3] == f"{folder}/%j_%t_log.out" and srun[-1] == folder
    flags = {k: v for k, _, v in (shlex.split(line)[1].partition("=") for line in script.splitlines()
                                  if line.startswith("#SBATCH --") and "=" in line)}
    assert flags["--job-name"] == HOSTILE_JOB_NAME and flags["--output"] == f"{folder}/%j_0_log.out"


def test_env_values_are_quoted():
    cfg = _compose(["+cluster=a100x8", "+cluster.env.WEIRD='a b; $(rm -rf /)'"])
    script = render_script(cfg, build_layout(cfg), RUN_DIR)
    assert "export WEIRD='a b; $(rm -rf /)'" in script


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun on PATH")
def test_dry_run_script_equals_submitits(tmp_path):
    import submitit

    cfg = _a100_two_nodes()
    layout = build_layout(cfg)
    executor = submitit.SlurmExecutor(folder=tmp_path / "slurm", python=submitit_adapter.task_python())
    executor.update_parameters(**slurm_parameters(cfg, layout))
    theirs = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    assert render_script(cfg, layout, tmp_path) == theirs
