"""Submission to Slurm with submitit: parameters, dry run, submit, wait.

One sweep point is one job: ``nodes`` x ``gpus_per_node`` srun tasks, one per GPU (per
CPU slot on CPU clusters). submitit writes the batch script, per-rank logs
(``slurm/%j_%t_log.out``) and the pickled :class:`train.job.TrainJob` under
``RUN_DIR/slurm``; the script used is copied to ``RUN_DIR/sbatch.sh``.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from slurm import query, sbatch
from train.config import ConfigError, RunConfig
from train.job import TrainJob
from train.layout import Layout

DEFAULT_LOCAL_DIR = "/tmp/localslurm"


def local_cluster_dir() -> Path:
    return Path(os.environ.get("LOCALSLURM_DIR", DEFAULT_LOCAL_DIR))


def resolve_slurm_conf(cfg: RunConfig) -> Optional[str]:
    """slurm.conf path for this cluster: "auto" finds `make cluster-up`'s cluster."""
    conf = cfg.cluster.slurm_conf
    if conf == "auto":
        path = local_cluster_dir() / "etc" / "slurm.conf"
        if not path.is_file():
            raise ConfigError(f"cluster.slurm_conf=auto: no local Slurm cluster at {path.parent.parent} "
                              "(slurm.conf missing); start it with `make cluster-up`")
        return str(path)
    conf = conf or os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        field = "cluster.slurm_conf" if cfg.cluster.slurm_conf else "SLURM_CONF"
        raise ConfigError(f"{field}={conf}: no such file; point it at the cluster's slurm.conf")
    return conf


# What Slurm said per (slurm.conf, partition) in this process: the controller and the
# partitions do not change while one sweep is checked, and asking once per point cost a
# `scontrol ping` + `sinfo` round trip each (~0.1 s per point). Failures are cached too,
# so a dead controller costs one timeout, not one per point.
_PING: Dict[Optional[str], Optional[str]] = {}
_PARTITION_NODES: Dict[Tuple[Optional[str], str], Union[int, str]] = {}


def check_slurm(cfg: RunConfig, slurm_conf: Optional[str]) -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError(f"cluster={cfg.cluster.name} needs Slurm but `sbatch` is not on PATH; run on a login "
                          "node, install Slurm's client (`make setup`), or use +cluster=local")
    if slurm_conf not in _PING:
        try:
            query.ping(query.slurm_env(slurm_conf))
            _PING[slurm_conf] = None
        except (query.SlurmUnavailable, OSError) as exc:
            _PING[slurm_conf] = str(exc).splitlines()[0][:160]
    if _PING[slurm_conf] is not None:
        where = slurm_conf or "the default slurm.conf"
        hint = "start it with `make cluster-up`" if cfg.cluster.slurm_conf == "auto" else \
            "set cluster.slurm_conf=PATH or SLURM_CONF, or use +cluster=local"
        raise ConfigError(f"cluster={cfg.cluster.name}: no Slurm controller answers ({where}): "
                          f"{_PING[slurm_conf]}; {hint}")
    partition = cfg.cluster.partition
    if partition:  # a job larger than its partition would pend forever
        key = (slurm_conf, partition)
        if key not in _PARTITION_NODES:
            try:
                _PARTITION_NODES[key] = query.partition_nodes(partition, query.slurm_env(slurm_conf))
            except query.SlurmUnavailable as exc:
                _PARTITION_NODES[key] = str(exc)[:160]
        total = _PARTITION_NODES[key]
        if isinstance(total, str):
            raise ConfigError(f"cluster.partition={partition}: {total}; pick an existing partition (sinfo -s)")
        if cfg.cluster.nodes > total:
            raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} exceeds the {total} nodes of partition "
                              f"{partition}; use cluster.nodes<={total}")


def slurm_parameters(cfg: RunConfig, layout: Layout) -> Dict[str, Any]:
    """submitit/sbatch parameters of this run (the same for dry run and submission)."""
    c = cfg.cluster
    setup = list(c.setup)
    try:
        setup += sbatch.export_lines(c.env)
    except ValueError as exc:
        raise ConfigError(f"cluster.env: {exc}; use letters, digits and _") from None
    params: Dict[str, Any] = {
        "job_name": cfg.launcher.job_name or f"sto-{cfg.model.name}-{cfg.strategy.name}",
        "nodes": c.nodes,
        "ntasks_per_node": c.gpus_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": setup,
        "additional_parameters": {"requeue": True},
    }
    if c.accelerator == "gpu":
        params["gpus_per_node"] = c.gpus_per_node
    optional = {"partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
                "exclude": c.exclude, "mem": f"{c.mem_gb}GB" if c.mem_gb else None}
    params.update({k: v for k, v in optional.items() if v})
    return params


def render_script(cfg: RunConfig, layout: Layout, run_dir: Path, python: Optional[str] = None) -> str:
    return sbatch.render(slurm_parameters(cfg, layout), run_dir / "slurm", python)


def submit(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str]):
    """Submit the job; return the submitit Job (returns as soon as sbatch answers)."""
    import submitit

    if slurm_conf:
        os.environ["SLURM_CONF"] = slurm_conf  # sbatch here and every task of the job read it
    executor = submitit.SlurmExecutor(folder=run_dir / "slurm", max_num_timeout=cfg.cluster.max_requeues)
    executor.update_parameters(**slurm_parameters(cfg, layout))
    job = executor.submit(TrainJob(str(run_dir)))
    try:
        shutil.copyfile(job.paths.submission_file, run_dir / "sbatch.sh")
    except OSError:
        pass
    return job


def wait(job_id: str, run_dir: Path, slurm_conf: Optional[str], poll_s: float = 1.0) -> str:
    """Block until the job leaves the queue; return its final Slurm state."""
    env = query.slurm_env(slurm_conf)
    terminal = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE")  # PREEMPTED jobs are requeued: keep waiting
    while True:
        rows = query.sacct([job_id], env)
        state = rows.get(job_id, {}).get("State", "PENDING").split()[0]
        if state in terminal:
            return state
        time.sleep(poll_s)
        print(".", end="", file=sys.stderr, flush=True)
