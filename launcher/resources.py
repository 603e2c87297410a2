"""What a job asks of each node and where its tasks run: the resources line the dry run
prints, a container's mounts and name. Torch-free; launcher/submit.py builds the job from them.

One srun task a node (a node's agent forking its ranks: train/harness/agent.py), except
with ``cluster.gpu_binding=task``, where each GPU is a task of its own (``cluster.agent()``).
"""
from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.snapshot import Frozen
from slurm import sbatch, submitit_adapter
from spec.config import ConfigError, RunConfig


def task_shape(cfg: RunConfig) -> Tuple[int, int]:
    """(srun tasks a node, CPUs a task): one agent a node with the node's CPUs
    (cluster.gpus_per_node x cluster.task_cpus()), or one task a rank with its own."""
    c = cfg.cluster
    return (1, c.gpus_per_node * c.task_cpus()) if c.agent() else (c.gpus_per_node, c.task_cpus())


def container_args(cfg: RunConfig, code: Optional[Frozen], run_dir: Optional[Path],
                   wrapper: Optional[str]) -> Tuple[List[str], List[str]]:
    """(--container-mounts items, more srun options) with cluster.container_image: the
    site's mounts, then the run's paths at the same place inside: the directory holding
    the run directory (with the frozen code, .code/<hash>, and a sweep's points and
    arrays) and the code whose task wrapper srun starts, when elsewhere; and a
    --container-name that follows the image, so that every step of the job (restarts
    inside it) and every node's next step reuse the imported container."""
    c = cfg.cluster
    if not c.container_image:
        return list(c.container_mounts), []
    runs = run_dir.parent if run_dir is not None else (code.copies[0][1].parent.parent if code is not None
                                                       and code.copies else None)
    own = code.task_python()[1] if code is not None else None
    tree = Path(wrapper or own or submitit_adapter.TASK_WRAPPER).parent.parent
    ours = [p for p in (runs, tree) if p is not None]
    ours = [p for p in dict.fromkeys(ours) if not any(q != p and p.is_relative_to(q) for q in ours)]
    for path in ours:
        if set(str(path)) & set(":,"):
            raise ConfigError(f"launcher.run_dir: {path} holds ':' or ',', which split pyxis's --container-mounts; "
                              "pick a directory without them")
    image = c.container_image
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "-", image.rsplit("/", 1)[-1].replace("#", "-"))[:40].strip("-.")
    name = f"sto-{tail}-{hashlib.sha256(image.encode()).hexdigest()[:8]}"
    return [*c.container_mounts, *(f"{p}:{p}" for p in ours)], [f"--container-name={name}"]


def image_python(cfg: RunConfig) -> str:
    """The interpreter inside cluster.container_image, as shell words: cluster.python, else
    the image's own ``python`` (never the login host's venv path, which the image lacks)."""
    return shlex.quote(cfg.cluster.python) if cfg.cluster.python else "python"


def in_image(cfg: RunConfig, run_dir: Path, cpus: int, gpus: int = 0,
             code: Optional[Frozen] = None) -> Tuple[str, Optional[str]]:
    """A job of the run's own that runs one command (an evaluation, a chain's step): with
    cluster.container_image, the words that run it in the image as the training's tasks
    run (srun's one task of ``cpus`` CPUs and ``gpus`` GPUs, asked again as srun inherits
    neither; the training's container options: :func:`slurm.sbatch.srun_args`, the run's
    mounts and container name) and the image's Python (:func:`image_python`); ("", None)
    without one: the batch script's own host runs it."""
    c = cfg.cluster
    if not c.container_image:
        return "", None
    mounts, named = container_args(cfg, code, run_dir, None)
    gpu = [f"--gpus={int(gpus)}"] if gpus else []
    srun = ["srun", "--ntasks=1", *sbatch.srun_args(cpus, gpu, [], c.container_image, mounts, c.container_workdir),
            *named]
    return " ".join(map(shlex.quote, srun)) + " ", image_python(cfg)


def resources_line(cfg: RunConfig) -> str:
    """What each node is asked for, in words and the options that ask it (the dry run prints it)."""
    c = cfg.cluster
    cpus = c.task_cpus()
    of = f" of cluster.cpus_per_node={c.cpus_per_node}" if c.cpus_per_node else ""
    how = "cluster.cpus_per_task=0: derived" if c.cpus_per_task == 0 else f"cluster.cpus_per_task={cpus}"
    total = c.gpus_per_node * cpus
    if c.agent():
        line = (f"asked per node: one task, the node's agent, forking {c.gpus_per_node} ranks x {cpus} CPUs = {total} "
                f"CPUs{of} ({how}; sbatch --ntasks-per-node=1, sbatch and srun --cpus-per-task={total}); memory: ")
    else:
        line = (f"asked per node: {c.gpus_per_node} tasks x {cpus} CPUs = {total} CPUs{of} ({how}; "
                f"sbatch and srun --cpus-per-task={cpus}); memory: ")
    if c.mem_gb is None:
        line += "the site's default (cluster.mem_gb=null: no --mem)"
    elif c.mem_gb == 0:
        line += "all of the node's (cluster.mem_gb=0: --mem=0)"
    else:
        line += f"{c.mem_gb} GB (--mem={submitit_adapter.mem_option(c.mem_gb)})"
    if c.spare_nodes:
        line += (f"; nodes: {c.nodes + c.spare_nodes} = {c.nodes} training + {c.spare_nodes} spare "
                 f"(cluster.spare_nodes={c.spare_nodes}: sbatch --nodes={c.nodes + c.spare_nodes} --no-kill, "
                 f"srun --nodes={c.nodes})")
    if c.accelerator != "gpu":
        return line + "; GPUs: none (cluster.accelerator=cpu)"
    if c.gpu_binding == "task":
        return line + (f"; GPU binding task: each task sees only its own GPU, cuda:0 (sbatch --ntasks="
                       f"{(c.nodes + c.spare_nodes) * c.gpus_per_node} --gpus-per-task=1, srun --gpus-per-task=1 --gpu-bind=per_task:1)")
    return line + (f"; GPU binding node: every rank sees the node's {c.gpus_per_node} GPUs and takes cuda:LOCAL_RANK "
                   f"(sbatch --gpus-per-node={c.gpus_per_node})")
