"""Pieces of a batch script: the ``export`` lines of a job's environment.

The script itself is submitit's (:func:`slurm.submitit_adapter.render`): parameters use
submitit's (= sbatch's) names (job_name, partition, time, nodes, ntasks_per_node,
cpus_per_task, gpus_per_node, mem, signal_delay_s, setup, ...), and the same mapping
feeds ``SlurmExecutor.update_parameters`` for the real submission, so the dry run shows
the script that will run (tested against submitit's own rendering).
"""
from __future__ import annotations

import re
import shlex
from typing import Any, Dict, List, Mapping, Optional, Sequence

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export KEY='value'`` lines; values are shell-quoted, keys must be identifiers."""
    lines = []
    for key in sorted(env):
        if not _ENV_NAME.match(key):
            raise ValueError(f"environment variable name {key!r} is not a shell identifier")
        lines.append(f"export {key}={shlex.quote(str(env[key]))}")
    return lines


def extra_options(extra: Mapping[str, Any]) -> Dict[str, Any]:
    """``cluster.sbatch_extra`` as submitit's ``additional_parameters``: ``true`` is a flag
    without value (``#SBATCH --exclusive``), anything else ``--key=VALUE`` with the value
    shell-quoted by submitit (sbatch's parser takes the quotes off again)."""
    return {str(k).replace("_", "-"): (True if v is True else str(v)) for k, v in extra.items()}


def srun_args(extra: Sequence[str], image: Optional[str], mounts: Sequence[str], workdir: Optional[str]) -> List[str]:
    """srun's options before the command: the user's own, then pyxis's ``--container-*``
    (each one argument: submitit quotes every item of the srun line)."""
    args = list(extra)
    if image:
        args.append(f"--container-image={image}")
    if mounts:
        args.append("--container-mounts=" + ",".join(mounts))
    if workdir:
        args.append(f"--container-workdir={workdir}")
    return args
