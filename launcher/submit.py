"""Submission to Slurm with submitit: parameters, dry run, submit, job arrays, wait.

One sweep point is one job (or one element of a job array of identical jobs, see
:func:`submit_array`): ``nodes`` x ``gpus_per_node`` srun tasks, one per GPU (per CPU
slot on CPU clusters). submitit writes the batch script, per-rank logs
(``slurm/%j_%t_log.out``; ``%A_%a_%t`` for array elements) and the pickled task call
(``train.job:main(RUN_DIR)``, :class:`slurm.submitit_adapter.TaskCall`) under
``RUN_DIR/slurm``; the script used is copied to ``RUN_DIR/sbatch.sh``.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from launcher.resources import container_args, image_python, task_shape
from launcher.snapshot import Frozen
from slurm import query, sbatch, submitit_adapter
from slurm.states import job_over, job_state
from slurm.submitit_adapter import TaskCall
from spec.cluster import heartbeat_interval
from spec.config import ConfigError, RunConfig
from spec.layout import Layout

DEFAULT_LOCAL_DIR = "/tmp/localslurm"
TASK = "train.job:main"  # what every task of a job runs, with the run directory


def task_call(run_dir: Path) -> TaskCall:
    return TaskCall(TASK, (str(run_dir),))


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


@dataclass
class SlurmProbe:
    """What Slurm said per (slurm.conf, partition) during one launch: the controller and the
    partitions do not change while one sweep is checked, and asking once per point cost a
    `scontrol ping` + `sinfo` round trip each (~0.1 s per point). Failures are kept too, so
    a dead controller costs one timeout, not one per point. A launch's session holds one."""

    ping: Dict[Optional[str], Optional[str]] = field(default_factory=dict)  # conf -> error or None
    partition_nodes: Dict[Tuple[Optional[str], str], Union[int, str]] = field(default_factory=dict)

    def ask(self, slurm_conf: Optional[str], partition: Optional[str]) -> None:
        """`scontrol ping` and the partition's size, side by side (one round trip's wait)."""
        from concurrent.futures import ThreadPoolExecutor

        env = query.slurm_env(slurm_conf)

        def ping() -> None:
            try:
                query.ping(env)
                self.ping[slurm_conf] = None
            except (query.SlurmUnavailable, OSError) as exc:
                self.ping[slurm_conf] = str(exc).splitlines()[0][:160]

        def size() -> None:
            try:
                self.partition_nodes[(slurm_conf, partition)] = query.partition_nodes(partition, env)
            except (query.SlurmUnavailable, OSError) as exc:
                self.partition_nodes[(slurm_conf, partition)] = str(exc)[:160]

        with ThreadPoolExecutor(max_workers=2) as pool:
            asked = [pool.submit(ping)] if slurm_conf not in self.ping else []
            if partition and (slurm_conf, partition) not in self.partition_nodes:
                asked.append(pool.submit(size))
            for future in asked:
                future.result()  # re-raises what the workers do not turn into a message


def check_slurm(cfg: RunConfig, slurm_conf: Optional[str], probe: SlurmProbe) -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError(f"cluster={cfg.cluster.name} needs Slurm but `sbatch` is not on PATH; run on a login "
                          "node, install Slurm's client (`make setup`), or use +cluster=local")
    partition = cfg.cluster.partition
    if slurm_conf not in probe.ping or (partition and (slurm_conf, partition) not in probe.partition_nodes):
        probe.ask(slurm_conf, partition)
    if probe.ping[slurm_conf] is not None:
        where = slurm_conf or "the default slurm.conf"
        hint = "start it with `make cluster-up`" if cfg.cluster.slurm_conf == "auto" else \
            "set cluster.slurm_conf=PATH or SLURM_CONF, or use +cluster=local"
        raise ConfigError(f"cluster={cfg.cluster.name}: no Slurm controller answers ({where}): "
                          f"{probe.ping[slurm_conf]}; {hint}")
    if partition:  # a job larger than its partition would pend forever
        total = probe.partition_nodes[(slurm_conf, partition)]
        if isinstance(total, str):
            raise ConfigError(f"cluster.partition={partition}: {total}; pick an existing partition (sinfo -s)")
        spares = cfg.cluster.spare_nodes
        if cfg.cluster.nodes + spares > total:
            asked = f"cluster.nodes={cfg.cluster.nodes}" + (f" + cluster.spare_nodes={spares}" if spares else "")
            raise ConfigError(f"{asked} exceeds the {total} nodes of partition {partition}; use "
                              f"{'cluster.nodes + cluster.spare_nodes' if spares else 'cluster.nodes'}<={total}")


def default_job_name(cfg: RunConfig) -> str:
    """"sto-MODEL-STRATEGY" for the built-in trainer, "sto-SCRIPT" / "sto-FUNCTION" for a user's entry point."""
    if not cfg.entrypoint:
        return f"sto-{cfg.model.name}-{cfg.strategy.name}"
    name = cfg.entrypoint.rsplit(":", 1)[-1] if ":" in cfg.entrypoint else Path(cfg.entrypoint).stem
    return f"sto-{name}"


def slurm_parameters(cfg: RunConfig, layout: Layout, code: Optional[Frozen] = None, python: Optional[str] = None,
                     run_dir: Optional[Path] = None, wrapper: Optional[str] = None,
                     allocation: bool = False) -> Dict[str, Any]:
    """submitit/sbatch parameters of this run (the same for dry run and submission): one
    task a node, the node's agent (STO_AGENT: it forks the node's ranks, train/harness/agent.py),
    with the node's CPUs; with cluster.gpu_binding=task one task per GPU, each with
    cluster.task_cpus() CPUs and its GPU (launcher.resources.task_shape). srun's
    --kill-on-bad-exit=1, so that a task that dies ends the step at once (the step loop
    records and restarts it: train.harness.restart.after_srun).
    ``code``: the run's frozen code (launcher.snapshot), first on the tasks' PYTHONPATH;
    ``python``: this interpreter's command when not sys.executable (render_script's);
    ``run_dir`` (a sweep's: any point's), ``wrapper``: for a container's mounts.
    ``allocation``: the script runs inside an allocation (launcher/allocation.py): no requeue."""
    c = cfg.cluster
    gpu: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    srun_gpu: List[str] = []
    nodes = c.nodes + c.spare_nodes  # the spares idle until a restart needs one (cluster.spare_nodes)
    if c.accelerator == "gpu":
        gpu, extra, srun_gpu = sbatch.gpu_binding(c.gpu_binding, c.gpus_per_node, nodes)
    tasks, cpus = task_shape(cfg)
    params = _job_parameters(cfg, cfg.launcher.job_name or default_job_name(cfg), nodes, tasks, cpus,
                             [*srun_gpu, "--kill-on-bad-exit=1"], code, run_dir, wrapper)
    grace = submitit_adapter.restart_grace_s(heartbeat_interval(c.hang_timeout_s))
    params.update(gpu, setup=params["setup"] + submitit_adapter.step_loop(
        c.in_job_restarts, job_pythons(cfg, code, python)[1], c.spare_nodes, c.nodes, tasks, grace,
        _task_python(code)[1], agent=c.gpus_per_node if c.agent() else 0, allocation=allocation),
                  teardown=[] if allocation else submitit_adapter.requeue_if_signalled(c.max_requeues))
    spare = {"no-kill": True} if c.spare_nodes else {}  # the job outlives a dead node
    params["additional_parameters"] = {"requeue": True, **spare, **extra, **params["additional_parameters"]}
    return params


def job_pythons(cfg: RunConfig, code: Optional[Frozen], python: Optional[str] = None) -> Tuple[str, str]:
    """(the tasks' Python, the batch script's own), as shell words. This interpreter
    (``python``, else the frozen copy's: with -P, else sys.executable) unless
    cluster.python names another; with cluster.container_image the tasks run the image's
    (cluster.python, else its ``python``) while the batch script stays on the host."""
    here = python or _task_python(code)[0] or shlex.quote(sys.executable)
    if cfg.cluster.container_image:
        return image_python(cfg), here
    given = shlex.quote(cfg.cluster.python) if cfg.cluster.python else None
    return given or here, given or here


def _job_parameters(cfg: RunConfig, job_name: str, nodes: int, tasks_per_node: int, cpus_per_task: int,
                    srun_own: List[str], code: Optional[Frozen] = None, run_dir: Optional[Path] = None,
                    wrapper: Optional[str] = None) -> Dict[str, Any]:
    """What every job of a run shares (training and conversion): name, shape, time, the
    site's options, Slurm's client as found after the site's setup (before cluster.env,
    which may hide it from the tasks), the environment (the frozen code's PYTHONPATH last,
    so it comes first), the srun line, and no submitit wckey."""
    c = cfg.cluster
    setup = list(c.setup) + submitit_adapter.slurm_client_lines()
    try:
        setup += sbatch.export_lines(c.env)
    except ValueError as exc:
        raise ConfigError(f"cluster.env: {exc}; use letters, digits and _") from None
    setup += code.setup_lines() if code is not None else []
    mounts, container = container_args(cfg, code, run_dir, wrapper)
    params: Dict[str, Any] = {
        "job_name": job_name,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": setup,
        "srun_args": sbatch.srun_args(cpus_per_task, srun_own, c.srun_args, c.container_image, mounts,
                                      c.container_workdir) + container,
        "additional_parameters": sbatch.extra_options(c.sbatch_extra),
        **submitit_adapter.NO_WCKEY,
    }
    optional = {"partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
                "exclude": c.exclude, "mem": submitit_adapter.mem_option(c.mem_gb)}  # "0" for 0: a string
    params.update({k: v for k, v in optional.items() if v})
    return params


def _task_python(code: Optional[Frozen]) -> Tuple[Optional[str], Optional[str]]:
    """(python, wrapper) of every task: the frozen copy's when there is one, else the defaults."""
    return code.task_python() if code is not None else (None, None)


def render_script(cfg: RunConfig, layout: Layout, run_dir: Path, python: Optional[str] = None,
                  wrapper: Optional[str] = None, code: Optional[Frozen] = None, allocation: bool = False) -> str:
    wrapper = wrapper or _task_python(code)[1]
    return submitit_adapter.render(slurm_parameters(cfg, layout, code, python, run_dir, wrapper, allocation),
                                   run_dir / "slurm", job_pythons(cfg, code, python)[0], wrapper)


def submit(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str], after: Optional[str] = None,
           code: Optional[Frozen] = None):
    """Submit the job; return the submitit Job (returns as soon as sbatch answers).
    ``after``: job ids (``:``-separated) it starts after, whatever their outcome (``afterany``).
    ``code``: the run's frozen code (launcher.snapshot), what every task imports."""
    if slurm_conf:
        os.environ["SLURM_CONF"] = slurm_conf  # sbatch here and every task of the job read it
    params = slurm_parameters(cfg, layout, code, run_dir=run_dir)
    if after:
        params["additional_parameters"]["dependency"] = f"afterany:{after}"
    job = submitit_adapter.submit(task_call(run_dir), run_dir / "slurm", params, cfg.cluster.max_requeues,
                                  job_pythons(cfg, code)[0], _task_python(code)[1])
    try:
        shutil.copyfile(job.paths.submission_file, run_dir / "sbatch.sh")
    except OSError:
        pass
    return job


CONVERT = "train.checkpoint.convert:run"  # the conversion job's one task, with the run directory and stage


def conversion_parameters(cfg: RunConfig, layout: Layout, code: Optional[Frozen] = None,
                          run_dir: Optional[Path] = None) -> Dict[str, Any]:
    """The conversion job's: one node, one task with the CPUs of all the node's tasks (srun
    asks for them too), the run's partition, account, memory, environment and container;
    no GPU, no requeue."""
    c = cfg.cluster
    name = f"{cfg.launcher.job_name or default_job_name(cfg)}-convert"
    return _job_parameters(cfg, name, 1, 1, c.task_cpus() * c.gpus_per_node, [], code, run_dir)


def submit_conversion(cfg: RunConfig, layout: Layout, run_dir: Path, stage: int, slurm_conf: Optional[str],
                      code: Optional[Frozen] = None) -> str:
    """Submit the universal conversion of the run's newest checkpoint for a ZeRO ``stage``
    load (:mod:`train.checkpoint.convert`) as a CPU job (:func:`conversion_parameters`).
    Its id, for the training job's dependency."""
    if slurm_conf:
        os.environ["SLURM_CONF"] = slurm_conf
    call = TaskCall(CONVERT, (str(run_dir), stage))
    return str(submitit_adapter.submit(call, run_dir / "slurm", conversion_parameters(cfg, layout, code, run_dir), 0,
                                       job_pythons(cfg, code)[0], _task_python(code)[1]).job_id)


# Elements per job array: Slurm's default MaxArraySize is 1001 (indices 0..1000).
ARRAY_MAX = 1000


class SubmissionError(RuntimeError):
    """sbatch refused a job (its message is the first line of sbatch's)."""


def submit_array(cfg: RunConfig, layout: Layout, run_dirs: List[Path], slurm_conf: Optional[str],
                 sweep_dir: Path, code: Optional[Frozen] = None, after: Optional[str] = None,
                 parallel: Optional[int] = None) -> List[str]:
    """Submit one job array for runs whose sbatch parameters are all those of ``cfg``;
    return the element ids ("ARRAY_TASK", e.g. "123_4") in the order of ``run_dirs``.

    Each run directory keeps its own submitit files and logs (status and report read
    ``slurm/*_log.err``; submitit's ``submit_array`` would put every element's into one
    folder). The array's folder is ``SWEEP/.arrays/<uid>/%a``, where ``<uid>/<i>`` links to
    element i's ``RUN_DIR/slurm``: Slurm expands ``%a`` in the ``--output`` paths, and
    submitit's job side in the folder where it finds the element's pickle. submitit's
    executor refuses such a folder for the array job itself, so the script is rendered
    with submitit's own function (as for a dry run), sbatch is called here, and the
    pickles are the ``DelayedSubmission`` files submitit itself writes.

    ``after``: job ids (``:``-separated) the array starts after (``afterany``);
    ``parallel``: at most this many elements run at once (``--array=...%K``). Capped, an
    array of more than ARRAY_MAX elements is cut in arrays that start one after the other.
    """
    ids: List[str] = []
    for first in range(0, len(run_dirs), ARRAY_MAX):
        ids += _submit_one_array(cfg, layout, run_dirs[first:first + ARRAY_MAX], slurm_conf, sweep_dir, code,
                                 after, parallel)
        if parallel:
            after = ids[-1].split("_")[0]
    return ids


def _submit_one_array(cfg: RunConfig, layout: Layout, run_dirs: List[Path], slurm_conf: Optional[str],
                      sweep_dir: Path, code: Optional[Frozen], after: Optional[str] = None,
                      parallel: Optional[int] = None) -> List[str]:
    if slurm_conf:
        os.environ["SLURM_CONF"] = slurm_conf  # sbatch here and every task of the job read it
    uid = uuid.uuid4().hex[:12]
    base = sweep_dir / ".arrays" / uid
    base.mkdir(parents=True)
    params = dict(slurm_parameters(cfg, layout, code, run_dir=run_dirs[0]), map_count=len(run_dirs),
                  array_parallelism=min(parallel or len(run_dirs), len(run_dirs)))
    if after:
        params["additional_parameters"] = {**params["additional_parameters"], "dependency": f"afterany:{after}"}
    script = submitit_adapter.render(params, base / "%a", job_pythons(cfg, code)[0], _task_python(code)[1])
    (base / "submission.sh").write_text(script)
    pending = []
    for i, run_dir in enumerate(run_dirs):
        (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(run_dir / "slurm", base), base / str(i))
        (run_dir / "sbatch.sh").write_text(script)
        tmp = run_dir / "slurm" / f".array-{uid}.pkl"  # renamed once the array's id is known
        submitit_adapter.dump_delayed(task_call(run_dir), tmp, params["time"], cfg.cluster.max_requeues)
        pending.append(tmp)
    try:
        array_id = query.sbatch(str(base / "submission.sh"))
    except query.SlurmUnavailable as exc:
        for tmp in pending:
            tmp.unlink(missing_ok=True)
        raise SubmissionError(f"sbatch refused the job array: {exc}") from None
    ids = [f"{array_id}_{i}" for i in range(len(run_dirs))]
    for job_id, tmp in zip(ids, pending):  # the job side waits up to 60 s for its pickle
        os.replace(tmp, tmp.with_name(f"{job_id}_submitted.pkl"))
    return ids


def poll_interval(elapsed_s: float, first_s: float, max_s: float) -> float:
    """Seconds until the next poll of Slurm: a tenth of the time waited so far, between
    ``first_s`` and ``max_s`` (a short job is seen ending at once; a day-long wait asks
    slurmdbd every ``max_s``, not every second)."""
    return min(max_s, max(first_s, 0.1 * elapsed_s))


def wait(job_id: str, run_dir: Path, slurm_conf: Optional[str], poll_s: float = 1.0, max_poll_s: float = 30.0) -> str:
    """Block until the job leaves the queue; return its final Slurm state."""
    env = query.slurm_env(slurm_conf)
    start = time.monotonic()
    while True:
        rows = query.sacct([job_id], env)
        state = job_state(rows.get(job_id, {}).get("State", "PENDING"))
        if job_over(state):  # a PREEMPTED job is requeued: keep waiting
            return state
        time.sleep(poll_interval(time.monotonic() - start, poll_s, max_poll_s))
        print(".", end="", file=sys.stderr, flush=True)
