"""Read the environment Slurm (srun) or torchrun gives each task, and expand host lists.

Pure standard library (and :mod:`spec.identity`, the shape read into): used by the
compute side to rendezvous and by the launcher.
"""
from __future__ import annotations

import os
import re
from typing import List, Mapping, Optional

from spec.identity import TaskIdentity

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


# Set by the batch script's step loop for each srun it starts (0 first, then 1, 2, ... for
# the restarts inside the job: slurm/step_loop.sh). Absent: nothing restarts the step.
IN_JOB_RESTART_ENV = "STO_IN_JOB_RESTART"


# Rendezvous ports of Slurm jobs: 25000-31999, below the kernel's ephemeral range (Linux:
# 32768-60999), which every outgoing connection (gloo's and NCCL's among them) and every
# bind to port 0 draws from: a port there can be any process's local end at the moment
# rank 0's TCPStore binds it (EADDRINUSE, seen in a loaded suite run: a restart's port,
# 29500 + (job + 4099) % 10000, was over 32767), and apart from local runs' 15000-24999
# (launcher/local.py).
RENDEZVOUS_PORTS = range(25000, 32000)


def rendezvous_port(job_id: str, base: int = RENDEZVOUS_PORTS.start, span: int = len(RENDEZVOUS_PORTS),
                    restart: int = 0) -> int:
    """A port every task of a job derives alike, differing between concurrent jobs and
    between the job's restarts inside its allocation (``restart``: a restarted step does
    not meet a socket of the step before it, nor a peer still bound to it).

    Array jobs ("123_4") and het jobs ("123+1") hash the whole id.
    """
    digits = re.sub(r"\D", "", str(job_id))
    number = int(digits) if digits else 0
    return base + (number + 4099 * restart) % span


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise KeyError(f"{key} is not set: not inside an srun task")
        return default
    # SLURM_TASKS_PER_NODE looks like "2(x3)": SLURM_NTASKS_PER_NODE is read instead.
    return int(value)


def in_srun_task(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def slurm_job_id(env: Mapping[str, str] | None = None) -> Optional[str]:
    """This job's id as Slurm's commands take it: "ARRAYID_TASKID" inside an element of a
    job array, else SLURM_JOB_ID (None outside a job). An element's raw SLURM_JOB_ID can
    equal the array's id, which squeue/sacct/scancel/scontrol take for the whole array."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


# Set by the local launcher on rank 0: the other local ranks' torchrun variables (JSON),
# which rank 0 forks after its imports (train/harness/forked.py).
LOCAL_FORK_ENV = "STO_LOCAL_FORK"
# Set by the batch script of a job whose srun starts one agent a node (its ranks per node:
# train/harness/agent.py), and by that agent in each rank it forks (marking it a rank).
AGENT_ENV = "STO_AGENT"
AGENT_CHILD_ENV = "STO_AGENT_RANK"
# Set by the local launcher for every rank: a token of this launch, which rank 0 of a user's
# code records in run.json (``local_launch``), so that a rank starting after rank 0 ended
# the run knows the end is this launch's (train/harness/user.py: job_id is "local" for all).
LOCAL_LAUNCH_ENV = "STO_LOCAL_LAUNCH"


def task_identity(env: Mapping[str, str] | None = None) -> TaskIdentity:
    """This task's :class:`~spec.identity.TaskIdentity`: torchrun's variables win (torchrun
    inside an allocation), then an srun task's SLURM_* ones, else a world of one. The job
    id is :func:`slurm_job_id`'s under every launcher. A rank a node's agent forked has both
    (train/harness/agent.py): its SLURM_* ones, with its in-job restart."""
    env = os.environ if env is None else env
    restarts = _int(env, "SLURM_RESTART_COUNT", 0)
    if AGENT_CHILD_ENV in env and in_srun_task(env):  # a node agent's rank: SLURM_* rewritten per rank
        return _srun_identity(env, restarts, in_job_restart(env))
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun_identity(env, restarts)
    if in_srun_task(env):
        return _srun_identity(env, restarts, in_job_restart(env))
    return TaskIdentity(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, master_addr="127.0.0.1",
                        master_port=0, job_id=slurm_job_id(env) or "single", restart_count=restarts, launcher="single")


def _torchrun_identity(env: Mapping[str, str], restarts: int) -> TaskIdentity:
    """A torchrun worker (or a local launcher's rank): its variables as given."""
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    return TaskIdentity(rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
                        local_world_size=local_world, node_rank=_int(env, "GROUP_RANK", rank // local_world),
                        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
                        job_id=slurm_job_id(env) or env.get("TORCHELASTIC_RUN_ID") or "local",
                        restart_count=restarts, launcher="torchrun")


def in_job_restart(env: Mapping[str, str] | None = None) -> Optional[int]:
    """Which start of the job's step loop this task belongs to (0: the first), None outside
    such a loop (a job without one, torchrun, a local run)."""
    env = os.environ if env is None else env
    value = env.get(IN_JOB_RESTART_ENV, "")
    return int(value) if value.isdigit() else None


def _srun_identity(env: Mapping[str, str], restarts: int, restart: Optional[int]) -> TaskIdentity:
    """An srun task: every task derives the same master (the first host of the step's node
    list) and port (from the raw SLURM_JOB_ID, which differs between array elements, and
    the step loop's restart index)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise KeyError("SLURM_JOB_NODELIST is not set: not inside a Slurm job")
    hosts = expand_hostlist(nodelist)
    world = _int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", 1))
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_JOB_NUM_NODES", len(hosts)))
    return TaskIdentity(rank=_int(env, "SLURM_PROCID"), world_size=world, local_rank=_int(env, "SLURM_LOCALID"),
                        local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", max(1, world // max(1, num_nodes))),
                        node_rank=_int(env, "SLURM_NODEID"), master_addr=hosts[0],
                        master_port=rendezvous_port(env.get("SLURM_JOB_ID") or slurm_job_id(env) or "0",
                                                    restart=restart or 0),
                        job_id=slurm_job_id(env) or "0", restart_count=restarts, launcher="srun",
                        in_job_restart=restart)
