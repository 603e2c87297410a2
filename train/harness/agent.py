"""One agent per node: the Slurm task that forks the node's ranks and watches them.

On Slurm (``cluster.agent()``: every binding but ``cluster.gpu_binding=task``) srun starts
one task a node (sbatch ``--ntasks-per-node=1``, the node's CPUs for it), which the batch
script marks with ``STO_AGENT`` = ranks per node. That task is the agent
(:class:`train.job.TrainJob` sees the mark): it imports once what the ranks need (the
built-in trainer's :func:`train.main.warm_imports`; torch for a user's code), then forks
the node's ranks, as torchrun's elastic agent and NVIDIA's ft_launcher do. Each child is
numbered by construction: RANK = SLURM_NODEID x ranks per node + local rank (block order
whatever srun's ``--distribution``), its SLURM_* variables rewritten to what one srun task
a rank would have seen (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ..., so a rank sees what
it saw before), the torchrun variables, its device by LOCAL_RANK, its CPUs next to its GPU
(:mod:`train.harness.affinity`, placed in the child before it runs anything) and its
output in ``RUN_DIR/slurm/<job>_<rank>_log.out|err`` (the names submitit gives task
<rank>'s; the agent's own lines, time-stamped, and submitit's after them go to
``<job>_agent<node>_log.out|err`` beside them).

Watching: the agent reaps its ranks every :data:`POLL_S`. A rank that exits non-zero or
dies by a signal (SIGKILL, the OOM killer, a segfault, SIGABRT from NCCL's watchdog:
nothing recorded by itself) is recorded at once, before its siblings are stopped
(:func:`train.harness.restart.after_srun` with ``detected_by="agent"``: run.json's
``rank_failure`` naming the rank, its node, the signal and the step, and the restart by
the usual rules), whatever its peers are doing (outside any collective, or in NCCL's,
which never see a closed socket). A restart of this start of the step
(``RUN_DIR/RESTART`` whose ``srun`` is the agent's start: asked by any rank of any node,
or by an agent) stops the node's ranks: :data:`STOP_S` for those already ending by
themselves (the rank that asked prints its traceback), then SIGKILL (run.json is written
atomically, checkpoints commit atomically: nothing committed is lost). Then, while the
restart drops no node, every agent forks fresh ranks for start k+1 from its warm state
(no imports, no new srun; the rendezvous port follows k+1). RESTART stays until the srun
ends, so that every agent reads it whenever it looks; each agent marks the start it
begins (``RUN_DIR/.RESTART.start<k+1>``), from which the batch script's loop knows, once
srun ends, which start was the last and that an earlier start's RESTART is done with.
With hot spares the srun holds every node of the job's and a spare's agent stands by,
warm, without ranks (:mod:`train.harness.agent_places`): a restart that drops nodes
gives each dropped node's place to a spare, and every agent left forks the next start's
ranks in its place, the spare's included. A refusal, a restart that drops nodes without
spares in the srun, or the end of the run ends the agent with its ranks' status (its
``end`` mark in RUN_DIR/.agents, with spares): srun's ``--kill-on-bad-exit`` ends the other nodes'
agents, and the batch script's loop (slurm/step_loop.sh) does the rest, as for per-rank
tasks.

Signals to the agent (Slurm's USR2 warning, SIGTERM, SIGINT) are passed to its ranks;
the agent itself never ends before them (Slurm's KillWait ends what is left). A rank
dies with its agent (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from slurm.env import (AGENT_CHILD_ENV, AGENT_ENV, IN_JOB_RESTART_ENV, expand_hostlist, in_job_restart, in_srun_task,
                       task_identity)
from spec.rundir import RESTART
from train.harness import agent_places
from train.harness.forked import Forwarding, run_child, warm_for_fork

POLL_S = 0.05  # how often the agent reaps its ranks
# How often it looks for RUN_DIR/RESTART (one stat a node): every 0.25 s, or less often from
# 256 nodes on, so that the job's agents together stat the shared filesystem at most 1,024
# times a second (512 nodes: every 0.5 s), about what their ranks' heartbeats write.
RESTART_POLL_S = 0.25
STATS_PER_S = 1024
STOP_S = 0.5  # once a restart is decided, how long the node's ranks may take to end by themselves
PASSED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
# A rank ended by one of these was ended from outside (scancel, a time limit, the warning
# signal before its handler): no failure, and its siblings, which got the same signal, end
# by themselves (a checkpoint first), bounded by Slurm's KillWait, not by the agent.
ENDED_BY_SLURM = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)


def is_agent(env: Optional[Mapping[str, str]] = None) -> bool:
    """This process is a node's agent: an srun task the batch script marked, not a rank."""
    env = os.environ if env is None else env
    return bool(env.get(AGENT_ENV)) and AGENT_CHILD_ENV not in env and in_srun_task(env)


def rank_env(env: Mapping[str, str], local_rank: int, per_node: int, start: Optional[int],
             placed: Optional[Tuple[int, List[str]]] = None) -> Dict[str, str]:
    """The variables of local rank ``local_rank`` of this node (``env``: the agent's, one srun
    task a node): block order by construction, the SLURM_* names as one task a rank has
    them, and torchrun's (:meth:`spec.identity.TaskIdentity.torchrun_vars`). ``placed``: the
    node's place and the training nodes in place order, when the srun also holds spares
    (:mod:`train.harness.agent_places`): the ranks see those as their step's nodes."""
    out: Dict[str, Any] = {}
    if placed is None:
        node = int(env["SLURM_NODEID"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env["SLURM_NTASKS"])
    else:
        (node, hosts), nodes = placed, len(placed[1])
        out.update(SLURM_NODEID=node, SLURM_STEP_NUM_NODES=nodes, SLURM_NNODES=nodes,
                   SLURM_STEP_NODELIST=",".join(hosts), SLURM_NODELIST=",".join(hosts))
    rank, world = node * per_node + local_rank, nodes * per_node
    shape = f"{per_node}(x{nodes})" if nodes > 1 else str(per_node)
    out.update({"SLURM_PROCID": rank, "SLURM_LOCALID": local_rank, "SLURM_NTASKS": world, "SLURM_NPROCS": world,
                "SLURM_STEP_NUM_TASKS": world, "SLURM_NTASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": shape,
                "SLURM_STEP_TASKS_PER_NODE": shape, AGENT_CHILD_ENV: 1})
    cpus = env.get("SLURM_CPUS_PER_TASK")
    if cpus and cpus.isdigit():  # the node's CPUs were asked for the agent: each rank's share
        out["SLURM_CPUS_PER_TASK"] = max(1, int(cpus) // per_node)
    if start is not None:
        out[IN_JOB_RESTART_ENV] = start
    out = {k: str(v) for k, v in out.items()}
    return {**out, **task_identity({**env, **out}).torchrun_vars()}


def task_output() -> Optional[Path]:
    """The file this process's stdout goes to (srun's ``--output`` of its task), if one."""
    try:
        return Path(os.readlink("/proc/self/fd/1"))
    except OSError:
        return None


def log_paths(rank: int, run_dir: str, mine: Optional[Path], task: str, agent: bool = False) -> Tuple[Path, Path]:
    """Where rank ``rank``'s stdout and stderr go: submitit's file names for task ``rank``
    beside the agent's task's (``mine``: ``<job>_<task>_log.out``), else
    RUN_DIR/logs/rank<R>.out|err. ``agent``: the agent's own of node ``rank``
    (``<job>_agent<node>_log.*``, else RUN_DIR/logs/agent<node>.*)."""
    suffix, who = f"_{task}_log.out", f"agent{rank}" if agent else str(rank)
    if mine is not None and mine.name.endswith(suffix) and mine.parent.is_dir():
        stem = mine.name[: -len(suffix)]
        return mine.with_name(f"{stem}_{who}_log.out"), mine.with_name(f"{stem}_{who}_log.err")
    logs, name = Path(run_dir) / "logs", f"agent{rank}" if agent else f"rank{rank}"
    return logs / f"{name}.out", logs / f"{name}.err"


def restart_of(run_dir: str) -> Optional[dict]:
    """RUN_DIR/RESTART's entry (its ``srun``: which start asked; ``exclude``: nodes it
    drops), None without one."""
    try:
        text = (Path(run_dir) / RESTART).read_text()
    except OSError:
        return None
    lines = text.splitlines()
    try:
        entry = json.loads(lines[0]) if lines else {}
    except ValueError:
        entry = {}
    entry["exclude"] = next((ln[len("exclude="):] for ln in lines if ln.startswith("exclude=")), "")
    return entry


class Agent(Forwarding):
    """The ranks of one node, forked from this warm process and watched (see the module)."""

    def __init__(self, run_dir: str, entry: Callable[[], int], per_node: int, budget: int, cluster: Any = None) -> None:
        self.run_dir, self.entry, self.per_node, self.budget = run_dir, entry, per_node, budget
        self.cluster = cluster  # the run's cluster section, for each rank's CPUs (None: not placed)
        self.children: Dict[int, int] = {}  # pid -> rank
        self.node = int(os.environ["SLURM_NODEID"])
        self.task, self.task_out = os.environ.get("SLURM_PROCID", "0"), task_output()  # before own_logs()
        nodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        self.look_s = max(RESTART_POLL_S, nodes / STATS_PER_S)
        self.host = socket.gethostname()
        self.seen: Tuple[Optional[tuple], Optional[dict]] = (None, None)  # RESTART's (stat key, entry)
        # with spares in the srun (agent_places): the training nodes; this node's Slurm name
        hosts = expand_hostlist(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST") or "")
        self.me = hosts[self.node] if self.node < len(hosts) else self.host
        n = os.environ.get(agent_places.PLACES_ENV, "")
        self.places = agent_places.places(hosts, int(n), ()) if n.isdigit() and int(n) < len(hosts) else None
        self.hosts, self.dropped = hosts, set()  # dropped: the nodes the job's restarts dropped (RESTART)
        if self.places is not None:  # for the step loop and the spares (agent_places)
            agent_places.mark(run_dir, self.me, "up")
        self.forward(PASSED)

    def asked(self) -> Optional[dict]:
        """RUN_DIR/RESTART's entry (:func:`restart_of`), read again only when a stat says it changed."""
        try:
            st = os.stat(Path(self.run_dir) / RESTART)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self.seen[0]:
            self.seen = (key, restart_of(self.run_dir))
        return self.seen[1]

    def say(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        print(f"{stamp} agent node {self.node} ({self.host}): {line}", file=sys.stderr, flush=True)

    def own_logs(self) -> None:
        """The agent's own output (and submitit's lines after this) to ``<job>_agent<NODE>_log.out|err``
        beside its ranks' files: srun's file of its task is also rank <task>'s."""
        out, err = log_paths(self.node, self.run_dir, self.task_out, self.task, agent=True)
        sys.stdout.flush()
        sys.stderr.flush()
        out.parent.mkdir(parents=True, exist_ok=True)
        for fd, path in ((1, out), (2, err)):
            new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(new, fd)
            os.close(new)

    def run(self) -> int:
        """Fork and watch the node's ranks, start after start; their exit status (0: done)."""
        code, start = 0, in_job_restart()
        while True:
            if self.places is not None and self.me not in self.places:  # a spare: warm, waiting for a place
                start = self.standby(start)
                if start is None:
                    return self.end(code)
            else:
                code = self.generation(start)
                asked = restart_of(self.run_dir) if start is not None else None
                if asked is None or asked.get("srun") != start or not self.replace(asked):
                    return self.end(code)  # done, refused, or a restart without nodes: the step loop's
                if self.places is not None and self.me not in self.places:
                    self.say(f"this node was dropped ({asked['exclude']}): its agent ends")
                    return self.end(0)
                start += 1
            (Path(self.run_dir) / f".{RESTART}.start{start}").touch()  # for the step loop once srun ends
            place = f" in place {self.places.index(self.me)}" if self.places is not None else ""
            self.say(f"restarting the node's ranks from the warm agent (start {start} of the step{place})")

    def replace(self, asked: dict) -> bool:
        """A restart of this start asked: True when the agents carry it (it drops no node, or
        the srun's spares take the dropped nodes' places: :attr:`places` updated)."""
        if not asked["exclude"]:
            return True
        if self.places is None:
            return False
        self.dropped |= set(agent_places.dropped_of(asked["exclude"]))
        places = agent_places.places(self.hosts, len(self.places), self.dropped)
        if places is None:
            self.say(f"no spare left in this step for {asked['exclude']}")
            return False
        self.places = places
        return True

    def standby(self, start: Optional[int]) -> Optional[int]:
        """A spare's agent: warm, until a restart gives its node a place (the start its ranks
        begin), or every training node's agent has ended (None)."""
        self.say(f"standing by, warm, for a place among {','.join(self.places or [])}")
        while True:
            asked = self.asked()
            if asked is not None and isinstance(asked.get("srun"), int) and asked["srun"] >= (start or 0):
                start = asked["srun"] + 1  # the restart every agent follows, whether it drops nodes or not
                if asked["exclude"] and not self.replace(asked):
                    return None
                if self.me in (self.places or ()):
                    return start
            elif agent_places.ended(self.run_dir, self.places or ()):
                return None
            time.sleep(self.look_s)

    def end(self, code: int) -> int:
        if self.places is not None:
            agent_places.mark(self.run_dir, self.me, "end", str(code))
        return code

    def fork(self, start: Optional[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        placed = (self.places.index(self.me), self.places) if self.places is not None else None
        for local in range(self.per_node):
            env = rank_env(os.environ, local, self.per_node, start, placed)
            pid = os.fork()
            if pid == 0:
                run_child(env, self.run_dir, self.entry, self.owner,
                          log_paths(int(env["RANK"]), self.run_dir, self.task_out, self.task),
                          self.per_node - 1, self.cluster)
            self.children[pid] = int(env["RANK"])

    def generation(self, start: Optional[int]) -> int:
        """One start of the node's ranks: the first failure's exit status, else 0."""
        self.fork(start)
        failure: Optional[int] = None
        stop_at: Optional[float] = None
        look = 0.0
        while self.children:
            for rank, code in self.reap():
                if code == 0 or failure is not None:
                    continue
                failure = code
                if stop_at is None and -code not in ENDED_BY_SLURM:  # the first death: recorded, then
                    self.record(rank, code, start)                    # its siblings are stopped
                    stop_at = time.monotonic() + STOP_S
            now = time.monotonic()
            if stop_at is None and start is not None and now >= look:
                asked = self.asked()
                if asked is not None and asked.get("srun") == start:
                    self.say(f"restart asked ({asked.get('reason')}, rank {asked.get('rank')}): stopping the node's ranks")
                    stop_at = now + STOP_S
                look = now + self.look_s
            if stop_at is not None and now >= stop_at:
                self.signal_children(signal.SIGKILL)
            time.sleep(POLL_S)
        return _status(failure or 0)

    def reap(self):
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                yield self.children.pop(pid), os.waitstatus_to_exitcode(status)

    def record(self, rank: int, code: int, start: Optional[int]) -> None:
        """A rank of this node ended badly: run.json's failure and the restart, unless a rank
        recorded its own (:func:`train.harness.restart.after_srun`)."""
        from slurm.env import slurm_job_id
        from train.harness.restart import after_srun

        sig = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None
        what = f"killed by {sig}" if sig else f"exited with code {code}"
        self.say(f"rank {rank} {what}")
        report = {"task": rank, "node": self.host, "signal": sig, "exit_code": None if sig else code,
                  "oom": False, "line": f"agent: rank {rank} on {self.host} {what}"}
        try:
            after_srun(Path(self.run_dir), _status(code), start or 0, self.budget if start is not None else 0,
                       slurm_job_id() or "0", report, self.say, detected_by="agent")
        except Exception as exc:  # noqa: BLE001 - the failure still ends the step; the loop records it
            self.say(f"failure not recorded ({type(exc).__name__}: {exc})")


def _status(code: int) -> int:
    """A process's exit status as a shell reports it (a signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def run_agent(run_dir: str, entry: Callable[[], int], warm: Callable[[str], None]) -> int:
    """The node's agent (``STO_AGENT`` ranks a node): ``warm(run_dir)`` (the workload's
    imports), then its ranks' lives."""
    from spec.config import to_run_config
    from spec.rundir import CONFIG

    per_node = int(os.environ[AGENT_ENV])
    cluster = to_run_config(Path(run_dir) / CONFIG).cluster  # read once for the node's ranks
    t0 = time.monotonic()
    warm_for_fork(run_dir, warm)
    agent = Agent(run_dir, entry, per_node, cluster.in_job_restarts, cluster)
    agent.own_logs()
    took = f"(imports {time.monotonic() - t0:.1f} s)"
    if agent.places is not None and agent.me not in agent.places:
        agent.say(f"a spare: {per_node} ranks once a dropped node's place is its {took}")
    else:
        first = agent.places.index(agent.me) if agent.places is not None else agent.node
        agent.say(f"{per_node} ranks from RANK {first * per_node} {took}")
    return agent.run()
