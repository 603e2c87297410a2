"""Render the sbatch script of a job exactly as submitit will submit it.

Parameters use submitit's (= sbatch's) names: job_name, partition, time, nodes,
ntasks_per_node, cpus_per_task, gpus_per_node, mem, signal_delay_s, setup, ... The
same mapping feeds ``SlurmExecutor.update_parameters`` for the real submission, so the
dry run shows the script that will run (tested against submitit's own rendering).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export KEY='value'`` lines; values are shell-quoted, keys must be identifiers."""
    lines = []
    for key in sorted(env):
        if not _ENV_NAME.match(key):
            raise ValueError(f"environment variable name {key!r} is not a shell identifier")
        lines.append(f"export {key}={shlex.quote(str(env[key]))}")
    return lines


def submitit_command(folder: str | Path, python: Optional[str] = None) -> str:
    """The command submitit's SlurmExecutor puts after ``srun``."""
    python = shlex.quote(sys.executable) if python is None else python
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def render(params: Dict[str, Any], folder: str | Path, python: Optional[str] = None) -> str:
    """The sbatch script for ``params`` (submitit parameter names) and a submitit folder."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = dict(params)
    if "mem" in params:
        from submitit.slurm.slurm import _convert_mem

        params["mem"] = _convert_mem(params["mem"])
    return _make_sbatch_string(command=submitit_command(folder, python), folder=folder, **params)
