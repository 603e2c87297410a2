"""Pieces of a batch script: the ``export`` lines of a job's environment, the head of a
script the toolkit writes itself (:func:`job_head`).

The script itself is submitit's (:func:`slurm.submitit_adapter.render`): parameters use
submitit's (= sbatch's) names (job_name, partition, time, nodes, ntasks_per_node,
cpus_per_task, gpus_per_node, mem, signal_delay_s, setup, ...), and the same mapping
feeds ``SlurmExecutor.update_parameters`` for the real submission, so the dry run shows
the script that will run (tested against submitit's own rendering).

What each task gets (sbatch(1) and srun(1) of Slurm 22.05, the option names unchanged
since): :func:`gpu_binding` the GPUs, :func:`srun_args` the CPUs again on the srun line,
since srun does not inherit sbatch's ``--cpus-per-task``.
"""
from __future__ import annotations

import re
import shlex
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export KEY='value'`` lines; values are shell-quoted, keys must be identifiers."""
    lines = []
    for key in sorted(env):
        if not _ENV_NAME.match(key):
            raise ValueError(f"environment variable name {key!r} is not a shell identifier")
        lines.append(f"export {key}={shlex.quote(str(env[key]))}")
    return lines


def job_head(options: Mapping[str, Any], setup: Sequence[str], env: Mapping[str, str]) -> List[str]:
    """The first lines of a batch script the toolkit writes itself (a chain's step, an
    evaluation): ``#SBATCH --key=VALUE`` for each option with a value (shell-quoted; ``True``:
    the flag alone, ``#SBATCH --requeue``), the site's setup lines (``cluster.setup``),
    then its environment (``cluster.env``)."""
    lines = ["#!/bin/bash"] + [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}"
                               for k, v in options.items() if v]
    return lines + list(setup) + export_lines(env)


def extra_options(extra: Mapping[str, Any]) -> Dict[str, Any]:
    """``cluster.sbatch_extra`` as submitit's ``additional_parameters``: ``true`` is a flag
    without value (``#SBATCH --exclusive``), anything else ``--key=VALUE`` with the value
    shell-quoted by submitit (sbatch's parser takes the quotes off again)."""
    return {str(k).replace("_", "-"): (True if v is True else str(v)) for k, v in extra.items()}


def gpu_binding(binding: str, gpus_per_node: int, nodes: int) -> Tuple[Dict[str, Any], Dict[str, Any], List[str]]:
    """How a node's GPUs reach its tasks: (submitit parameters, additional sbatch options,
    srun options).

    ``"node"``: ``--gpus-per-node=G``; every task of the step sees all G (srun's
    ``--gpu-bind``: "By default every spawned task can access every GPU allocated to the
    step"). ``"task"``: ``--gpus-per-task=1``, which "requires an explicit task count, e.g.
    -n, --ntasks" (sbatch(1)), hence ``--ntasks``; srun asks again for one GPU per task
    with ``--gpu-bind=per_task:1`` ("Each task will be bound to the number of gpus
    specified ... assigned in order to tasks"), which --gpus-per-task only implies, so a
    site's default binding (SLURM_GPU_BIND) cannot replace it.
    """
    if binding == "task":
        return ({"gpus_per_task": 1}, {"ntasks": nodes * gpus_per_node},
                ["--gpus-per-task=1", "--gpu-bind=per_task:1"])
    return {"gpus_per_node": gpus_per_node}, {}, []


def srun_args(cpus_per_task: int, gpu: Sequence[str], extra: Sequence[str], image: Optional[str],
              mounts: Sequence[str], workdir: Optional[str]) -> List[str]:
    """srun's options before the command: ``--cpus-per-task`` (srun(1): "The number of cpus
    per task specified for salloc or sbatch is not automatically inherited by srun and, if
    desired, must be requested again"; where tasks are bound to CPUs each would get one),
    the GPU binding's, the user's own, then pyxis's ``--container-*`` (each one argument:
    submitit quotes every item of the srun line)."""
    args = [f"--cpus-per-task={int(cpus_per_task)}", *gpu, *extra]
    if image:
        args.append(f"--container-image={image}")
    if mounts:
        args.append("--container-mounts=" + ",".join(mounts))
    if workdir:
        args.append(f"--container-workdir={workdir}")
    return args
