"""Local ranks forked from rank 0 after the imports, not each started from scratch.

``python -m launcher`` on this machine (no Slurm) starts rank 0 as ``python -m train
RUN_DIR`` with the other ranks' environments in ``STO_LOCAL_FORK`` (JSON). Rank 0
imports torch and the modules its strategy needs once, then forks ranks 1..N-1: each
child takes its torchrun variables, sends its output to ``logs/rank{R}.out`` and runs
the same entry point, without paying the imports again (the workload says which:
:func:`train.main.warm_imports`; torch, DTensor, DCP, DeepSpeed: 2.5-4 s of CPU a
rank here, so a 4-rank run saves 8-12 s of CPU). Nothing
runs a torch operation, starts a thread or touches a device before the fork, so the
children start as clean as spawned processes (CUDA is initialised only after it). Each
child first takes its CPUs (``cluster.cpu_bind``, :mod:`train.harness.affinity`), and rank 0
its own once the children are forked: whatever a rank starts afterwards inherits them.

Supervision stays what the launcher did for separate processes: when a rank fails the
others get SIGTERM, and after :data:`GRACE_S` the stragglers SIGKILL; rank 0 exits with
the first failure's status. A child dies with rank 0 (``PR_SET_PDEATHSIG``: SIGKILL, as
no collective, a checkpoint's included, can finish without rank 0). A child keeps the
signal handlers it inherits (the workload's own, e.g. the preemption flag installed
before the imports), so a signal between the fork and its first step is not lost. Signals sent to rank 0 (USR2, TERM) are
passed on to the children, as a signal to the launcher's ranks reached them all.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from slurm.env import LOCAL_FORK_ENV

GRACE_S = 10.0  # as the launcher waited for a rank after SIGTERM before SIGKILL
PR_SET_PDEATHSIG = 1


class Forwarding:
    """A parent of forked ranks (``children``: pid -> rank) that passes the signals it gets
    on to them, then runs its own handler; a rank forked later inherits the handler, which
    then runs only the rank's own (``owner``: the parent's pid)."""

    children: Dict[int, int]
    owner: int
    signalled: bool = False  # a signal came to the parent (passed on to the children)

    def forward(self, signals) -> None:
        self.owner = os.getpid()
        for sig in signals:
            signal.signal(sig, self._forwarder(signal.getsignal(sig)))

    def _forwarder(self, previous) -> Callable:
        def forward(signum, frame) -> None:
            if os.getpid() == self.owner:
                self.signalled = True
                self.signal_children(signum)
            if callable(previous):
                previous(signum, frame)
            elif os.getpid() != self.owner:  # a rank whose own disposition is the default (or
                signal.signal(signum, previous)  # ignore): that, as if this handler were not there
                os.kill(os.getpid(), signum)
        return forward

    def signal_children(self, signum: int) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


class Supervisor(Forwarding):
    """Rank 0's view of the children it forked (pid -> rank)."""

    def __init__(self, children: Dict[int, int], run_dir: Optional[str] = None) -> None:
        self.children = dict(children)
        self.run_dir = run_dir
        self.failure: Optional[int] = None  # first failing child's exit status
        self.failed_rank: Optional[int] = None  # its rank, when it failed before any signal came
        self.lock = threading.Lock()
        self.forward((signal.SIGUSR2, signal.SIGTERM))  # passed on, then rank 0's own handler
        threading.Thread(target=self._watch, name="local-ranks", daemon=True).start()

    def _reap(self, block: bool) -> None:
        with self.lock:  # the watcher thread and finish() both reap
            self._reap_locked(block)

    def _reap_locked(self, block: bool) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                rank = self.children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                if code and self.failure is None:
                    self.failure = code if code > 0 else 128 - code
                    self.failed_rank = None if self.signalled else rank
                    print(f"rank {rank} exited with status {code}: stopping the other ranks",
                          file=sys.stderr, flush=True)
                    self.signal_children(signal.SIGTERM)
                    os.kill(os.getpid(), signal.SIGTERM)
                    threading.Thread(target=self._deadline, daemon=True).start()

    def _watch(self) -> None:
        while self.children:
            self._reap(block=False)
            time.sleep(0.1)

    def _deadline(self) -> None:
        """A rank failed and the rest were asked to stop: bound how long they may take."""
        time.sleep(GRACE_S)
        self.signal_children(signal.SIGKILL)
        os._exit(self.failure or 1)

    def finish(self, code: int) -> int:
        """Rank 0 is done (``code``): stop and reap the children; the first failure's status."""
        if self.children and code:
            self.signal_children(signal.SIGTERM)
        deadline = time.time() + (GRACE_S if code else 24 * 3600.0)
        while self.children and time.time() < deadline:
            self._reap(block=False)
            time.sleep(0.05)
        self.signal_children(signal.SIGKILL)
        while self.children:
            self._reap(block=True)
        self._record_failure()
        return code or self.failure or 0

    def _record_failure(self) -> None:
        """A child failed and its SIGTERM stopped rank 0 before rank 0 met a failure of its
        own: rank 0 recorded the run ``interrupted`` (what a SIGTERM means). It failed."""
        if self.failed_rank is None or not self.run_dir:
            return
        from spec.rundir import Status, update_run_json

        update_run_json(self.run_dir, unless=lambda info: info.get("status") != Status.INTERRUPTED,
                        status=Status.FAILED, ended_at=time.time(),
                        error=f"rank {self.failed_rank} exited with status {self.failure} (the other ranks were stopped)")


def run_child(rank_env: Dict[str, str], run_dir: str, entry: Callable[[], int], parent: int,
              logs: Tuple[Path, Path], forked: int, cluster: Any) -> None:
    """In a forked child: become that rank (``rank_env``), send stdout and stderr to
    ``logs``, take its CPUs, run ``entry``, exit (never returns). ``parent``: the process
    that forked it (the child dies with it); ``forked``: how many ranks it forked besides
    itself (local rank 0 here, train/harness/agent.py: none); ``cluster``: the run's cluster
    section, read once by the parent (:func:`cluster_of`), for the rank's CPUs."""
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no rank 0 (no agent): no collective can finish
        if os.getppid() != parent:  # the parent died between the fork and the prctl
            os._exit(1)
        os.environ.update(rank_env)
        os.environ.pop(LOCAL_FORK_ENV, None)
        logs[0].parent.mkdir(parents=True, exist_ok=True)
        for fd, path in ((1, logs[0]), (2, logs[1])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        _place(cluster, rank_env, run_dir, forked)
        code = entry()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (reported like an uncaught exception, then the status)
        traceback.print_exc()
    finally:
        import atexit
        import logging

        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit (handlers of the imports
            # before the fork too, as a spawned rank registers them from its own imports)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# torch.cuda.is_available() and device_count() ask the CUDA driver (cuInit) unless this is
# set, and a process forked after that cannot use CUDA; with it they ask NVML, which leaves
# fork safe (torch.cuda.is_available's note). DeepSpeed's import asks both (its accelerator
# detection), so the warm parent sets it before the imports; the ranks inherit it.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def warm_for_fork(run_dir: str, warm: Callable[[str], None]) -> None:
    """``warm(run_dir)`` in a parent that forks ranks afterwards, without touching CUDA."""
    os.environ.setdefault(NVML_CHECK, "1")
    warm(run_dir)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a rank's CUDA would fail after the fork
        raise RuntimeError("CUDA was initialised by the imports before the ranks are forked (a module imported "
                           f"by the workload uses the GPU at import); {NVML_CHECK}=1 did not prevent it: "
                           "report the module, or run one srun task a rank (cluster.gpu_binding=task)")


def fork_ranks(run_dir: str, entry: Callable[[], int], warm: Callable[[str], None]) -> Optional[Supervisor]:
    """In rank 0 started with ``STO_LOCAL_FORK``: ``warm(run_dir)`` (the workload's imports),
    then fork the other ranks (each runs ``entry``) and return their supervisor; None
    without the variable."""
    spec = os.environ.pop(LOCAL_FORK_ENV, None)
    if not spec:
        return None
    ranks: List[Dict[str, str]] = json.loads(spec)
    warm_for_fork(run_dir, warm)
    (Path(run_dir) / "logs").mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    children: Dict[int, int] = {}
    parent, cluster = os.getpid(), cluster_of(run_dir)
    logs = Path(run_dir) / "logs"
    for rank_env in ranks:
        out = logs / f"rank{rank_env['RANK']}.out"
        pid = os.fork()
        if pid == 0:
            run_child(rank_env, run_dir, entry, parent, (out, out), len(ranks), cluster)
        children[pid] = int(rank_env["RANK"])
    _place(cluster, os.environ, run_dir, len(ranks))  # rank 0, once its children have the task's CPUs
    return Supervisor(children, run_dir)


def cluster_of(run_dir: str) -> Any:
    """The run's cluster section (None without a config: nothing is placed)."""
    from spec.config import to_run_config
    from spec.rundir import CONFIG

    path = Path(run_dir) / CONFIG
    try:
        return to_run_config(path).cluster if path.is_file() else None
    except Exception:  # noqa: BLE001 - the rank reports a bad config itself, as it reads it
        return None


def _place(cluster: Any, env: Mapping[str, str], run_dir: str, forked: int) -> None:
    """This rank's CPUs (:mod:`train.harness.affinity`), in a child right after the fork,
    before it runs anything: every thread and process it starts inherits them. ``forked``:
    how many ranks rank 0 forked (the node's local ranks are those and rank 0; without
    LOCAL_WORLD_SIZE in ``env``)."""
    if cluster is None:
        return
    from train.harness.affinity import bind_rank
    from train.harness.run import rank_logger

    rank = int(env.get("RANK", 0))
    log = rank_logger(Path(run_dir), rank)
    try:
        bind_rank(cluster, int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", forked + 1)),
                  log=log.info, rank=rank)
    except Exception as exc:  # noqa: BLE001 - a placement, never a reason not to run
        log.info(f"rank {rank}: CPUs not placed ({type(exc).__name__}: {exc})")
