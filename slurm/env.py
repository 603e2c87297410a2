"""Read the environment Slurm (srun) gives each task, and expand host lists.

Pure standard library: used by the compute side to rendezvous and by the launcher.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

# A host list is comma-separated items; an item is a prefix, optionally followed by a
# bracketed range list, optionally followed by more text: "gpu[01-03,07]", "a[1-2]b[3-4]".
_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return [p for p in (x.strip() for x in parts) if p]


def _expand_ranges(spec: str) -> List[str]:
    out: List[str] = []
    for piece in spec.split(","):
        piece = piece.strip()
        if not piece:
            continue
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()):
                raise ValueError(f"bad range {piece!r} in host list")
            width = len(lo)  # zero padding is kept: 01-03 -> 01 02 03
            if int(hi) < int(lo):
                raise ValueError(f"descending range {piece!r} in host list")
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            if not piece.isdigit():
                raise ValueError(f"bad index {piece!r} in host list")
            out.append(piece)
    return out


def _expand_item(item: str) -> List[str]:
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    return [head + idx + rest for idx in _expand_ranges(match.group(1)) for rest in _expand_item(tail)]


def expand_hostlist(text: str) -> List[str]:
    """``"gpu[01-03,07],cpu1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]`` (Slurm's order)."""
    hosts: List[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item))
    return hosts


def rendezvous_port(job_id: str, base: int = 29500, span: int = 10000) -> int:
    """A port every task of a job derives alike, differing between concurrent jobs.

    Array jobs ("123_4") and het jobs ("123+1") hash the whole id.
    """
    digits = re.sub(r"\D", "", str(job_id))
    number = int(digits) if digits else 0
    return base + number % span


@dataclass(frozen=True)
class SlurmTaskEnv:
    """The parts of one srun task's environment that rendezvous needs."""

    # Slurm's id of this job: "ARRAYID_TASKID" for an element of a job array, the id
    # squeue/sacct/scancel/scontrol take for that element alone (its raw SLURM_JOB_ID can
    # equal the array's id, which those commands take for the whole array).
    job_id: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    hostnames: List[str]
    restart_count: int
    # SLURM_JOB_ID: unique per job and per array element, so the rendezvous port of
    # concurrent elements differs (empty: use job_id).
    raw_job_id: str = ""

    @property
    def master_addr(self) -> str:
        return self.hostnames[0]

    @property
    def master_port(self) -> int:
        return rendezvous_port(self.raw_job_id or self.job_id)


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise KeyError(f"{key} is not set: not inside an srun task")
        return default
    # SLURM_TASKS_PER_NODE looks like "2(x3)"; callers use _tasks_per_node for that.
    return int(value)


def in_srun_task(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def slurm_job_id(env: Mapping[str, str] | None = None) -> Optional[str]:
    """This job's id as Slurm's commands take it: "ARRAYID_TASKID" inside an element of a
    job array, else SLURM_JOB_ID (None outside a job)."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID")


def slurm_task_env(env: Mapping[str, str] | None = None) -> SlurmTaskEnv:
    """Parse the SLURM_* variables of an srun task."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise KeyError("SLURM_JOB_NODELIST is not set: not inside a Slurm job")
    hosts = expand_hostlist(nodelist)
    world = _int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", 1))
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_JOB_NUM_NODES", len(hosts)))
    local_world = _int(env, "SLURM_NTASKS_PER_NODE", max(1, world // max(1, num_nodes)))
    return SlurmTaskEnv(
        job_id=slurm_job_id(env) or "0",
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID"),
        local_world_size=local_world,
        node_rank=_int(env, "SLURM_NODEID"),
        num_nodes=num_nodes,
        hostnames=hosts,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        raw_job_id=env.get("SLURM_JOB_ID", "0"),
    )


# Set by the local launcher on rank 0: the other local ranks' torchrun variables (JSON),
# which rank 0 forks after its imports (train/harness/forked.py).
LOCAL_FORK_ENV = "STO_LOCAL_FORK"


@dataclass(frozen=True)
class TaskEnv:
    """Where one task stands in its job: the one shape of a task's environment.

    Read (:func:`task_env`) from torchrun's variables, from an srun task's SLURM_* ones, or
    from neither (one process); written back (:meth:`torchrun_vars`) as the variables
    torchrun gives a worker, for the local launcher's ranks and for whatever a task runs.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str = "local"
    restart_count: int = 0
    launcher: str = "torchrun"  # torchrun | srun | single

    def torchrun_vars(self) -> Dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def task_env(env: Mapping[str, str] | None = None) -> TaskEnv:
    """This task's :class:`TaskEnv`: torchrun's variables win (torchrun inside an
    allocation), then srun's, else a world of one."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return TaskEnv(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                       local_world_size=local_world, node_rank=int(env.get("GROUP_RANK", rank // local_world)),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
                       job_id=env.get("SLURM_JOB_ID", env.get("TORCHELASTIC_RUN_ID", "local")),
                       restart_count=int(env.get("SLURM_RESTART_COUNT", 0) or 0), launcher="torchrun")
    if in_srun_task(env):
        t = slurm_task_env(env)
        return TaskEnv(rank=t.rank, world_size=t.world_size, local_rank=t.local_rank,
                       local_world_size=t.local_world_size, node_rank=t.node_rank, master_addr=t.master_addr,
                       master_port=t.master_port, job_id=t.job_id, restart_count=t.restart_count, launcher="srun")
    return TaskEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, master_addr="127.0.0.1",
                   master_port=0, job_id="single", launcher="single")
