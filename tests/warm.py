"""Warm processes for the multi-rank tests: the launcher and its ranks forked from one
process that has imported torch, DeepSpeed and the project once.

Each ``python -m launcher ...`` of a CPU test used to start a fresh interpreter, then a
fresh rank 0 that imported torch, DTensor, DCP, dynamo and the strategy's engine: about
7 s of CPU (11 s with DeepSpeed) before the first step of a tiny model that trains in
one or two. With a few hundred such runs the imports were most of the suite's CPU.

The server (this file run as a script) imports all of that once and never runs a torch
operation, starts a thread or initialises a process group; every request is a fresh
``fork()`` of it, so no state passes from one run to the next. A request is
``python -m MODULE ARGS`` (the launcher, ``launcher.resume``) run as ``-m`` runs it
(``runpy``, ``__main__``), in its own process group, with the caller's cwd, environment,
stdout and stderr files; the ranks it starts locally are forks too: ``launcher.local``
starts rank 0 as ``python -m train RUN_DIR`` with ``subprocess.Popen``, which inside a
warm launcher forks (:class:`_RankProcess`) and runs ``train/__main__.py`` the same way,
and rank 0 forks the other ranks as it always does (train.harness.forked). Everything
the launcher and the ranks do is their own code; only the interpreter start and the
imports are skipped. The real start-up stays covered by the tests that still run
``conftest.launcher`` (tests/test_ddp.py, test_checkpoint.py's signals, test_cli.py,
the Slurm tests).

What a fork inherits that a fresh process would not have, and how it is put back:
the environment and cwd (replaced by the request's), Python's ``random`` state
(reseeded), the logging configuration the launcher's Hydra applied (restored for rank 0
to what it was before the launcher ran), and modules already imported (the point). Settings read
only at import time come from the server's environment (OMP_NUM_THREADS=1, as every
local rank gets, and TORCH_EXTENSIONS_DIR).
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

REPO = Path(__file__).resolve().parent.parent
TESTS = str(Path(__file__).resolve().parent)
EXTENSIONS = str(REPO / ".cache" / "torch_extensions")
# What the caller's PYTHONPATH held, kept behind the checkout for every process a test starts:
# a GPU machine's `make test-gpu` finds the wheels of `make gpu-wheels` there (bench/gpu_check.sh).
_OUTER_PATH = os.environ.get("PYTHONPATH", "")


def pythonpath(repo: Path = REPO) -> str:
    """PYTHONPATH for a process a test starts: ``repo`` first, then what the suite was given."""
    return os.pathsep.join(dict.fromkeys(p for p in [str(repo), *_OUTER_PATH.split(os.pathsep)] if p))  # DeepSpeed's compiled CPU comms, as tests/test_strategies.py


# --- the server ---------------------------------------------------------------------------

def preload() -> None:
    """Everything a launcher or a rank of any strategy imports. Not the ``__main__``
    modules that requests run (``-m`` executes them fresh)."""
    import importlib
    import pkgutil

    import hydra  # noqa: F401
    import launcher.launch  # noqa: F401
    import launcher.overrides  # noqa: F401
    import launcher.track.resume  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import train.harness.forked  # noqa: F401
    import train.loop  # noqa: F401
    import train.main  # noqa: F401
    from train.torch_compat import import_dynamo

    import_dynamo()  # the optimizer's constructor imports it
    import train.strategies

    for info in pkgutil.iter_modules(train.strategies.__path__):  # every engine, DeepSpeed's included
        importlib.import_module(f"train.strategies.{info.name}")
    # deepspeed.initialize imports its Muon optimizer (to check the optimizer's type), whose
    # @torch.compile decorators import torch's inductor: ~3 s of CPU in every DeepSpeed rank.
    # Its import logs to stdout, this server's reply channel: fd 1 points at stderr meanwhile
    # (DeepSpeed's handler keeps sys.stdout, so a forked rank's logs go where its fd 1 goes).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def serve() -> None:
    """One request a line on stdin (JSON), one reply a line on stdout: its exit status."""
    preload()
    import gc
    import threading

    gc.freeze()  # as train.main.freeze_imports: a fork's collections neither scan nor copy the imports

    assert threading.active_count() == 1, threading.enumerate()  # a fork copies only this thread
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.write(json.dumps(_serve_one(request)) + "\n")
        sys.stdout.flush()


def _serve_one(request: dict) -> dict:
    """Fork the request's processes (one for a module, ``ranks`` for a call), wait for them
    until its timeout, then SIGKILL their process group."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pids: List[int] = []
    for rank in range(request.get("ranks", 1)):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, pids[0] if pids else 0)
        _join_group(pid, pids[0] if pids else pid)  # here too: before any child can look for it
        pids.append(pid)
    codes, deadline = {}, time.time() + request["timeout"]
    while len(codes) < len(pids) and time.time() < deadline:
        for pid in pids:
            done, status = (0, 0) if pid in codes else os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = status
        time.sleep(0.05)
    timed_out = len(codes) < len(pids)
    if timed_out:
        try:
            os.killpg(pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
    code = _reap(pids, codes)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the request, reaped
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"returncode": code, "timed_out": timed_out, "cpu_s": round(cpu, 2)}


def _join_group(pid: int, group: int) -> None:
    try:
        os.setpgid(pid, group)
    except OSError:  # already done by the child itself, or the child has exited
        pass


def _reap(pids: List[int], statuses: dict) -> int:
    """The first non-zero exit status of ``pids`` (negative: the signal), else 0; waits
    for those not reaped yet."""
    code = 0
    for pid in pids:
        status = statuses[pid] if pid in statuses else os.waitpid(pid, 0)[1]
        code = code or os.waitstatus_to_exitcode(status)
    return code


def _child(request: dict, rank: int, group: int) -> None:
    """A forked request: its own files, cwd and environment, then run it (never returns)."""
    import random

    code = 1
    try:
        _join_group(0, group)  # the first process leads the group that a timeout kills
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # as `python -m` puts the cwd first; tests/ only where a test's function runs
        sys.path[:] = [os.getcwd()] + [p for p in sys.path[1:] if request["kind"] == "call" or p != TESTS]
        random.seed()
        code = _run(request, rank)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (printed as an uncaught exception, then status 1)
        import traceback

        traceback.print_exc()
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """What the interpreter does at exit (atexit handlers, logging), then leave at once."""
    import logging

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(request: dict, rank: int) -> int:
    if request["kind"] == "call":  # module:function(rank, *args), args pickled
        import importlib

        module, name = request["function"].split(":")
        with open(request["args"], "rb") as f:
            args = pickle.load(f)
        getattr(importlib.import_module(module), name)(rank, *args)
        return 0
    if request["module"].split(".")[0] == "launcher":  # its local ranks (launcher.resume's too): forked here
        import launcher.local

        launcher.local.subprocess = _WarmSubprocess(_logging_state())
    return _run_module(request["module"], request["args"])


def _run_module(module: str, args: List[str]) -> int:
    """``python -m MODULE ARGS``: the module (or package's __main__) executed as __main__."""
    import runpy

    for name in (module, f"{module}.__main__"):
        sys.modules.pop(name, None)  # executed fresh, as -m does, never the imported copy
    sys.argv = ["-m", *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _logging_state() -> dict:
    """Each logger's level, handlers, propagation and disabled flag (root included)."""
    import logging

    loggers = [logging.root] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                if isinstance(lg, logging.Logger)]
    return {lg: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}


def _restore_logging(state: dict) -> None:
    """Undo what the launcher's Hydra did (``disable_existing_loggers``, root at ERROR):
    a rank starts with logging as its own imports left it."""
    for logger, (level, handlers, propagate, disabled) in state.items():
        logger.level, logger.handlers, logger.propagate, logger.disabled = level, list(handlers), propagate, disabled


class _WarmSubprocess:
    """``launcher.local``'s view of :mod:`subprocess`: ``Popen`` of ``python -m train
    RUN_DIR`` forks (:class:`_RankProcess`); anything else is the real module's."""

    def __init__(self, logging_state: dict) -> None:
        self.logging_state = logging_state

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, cmd, env=None, stdout=None, stderr=None, **kwargs):  # noqa: N802
        if list(cmd[1:3]) != ["-m", "train"] or kwargs:
            return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, **kwargs)
        return _RankProcess(cmd, env, stdout, stderr, self.logging_state)


class _RankProcess:
    """A rank forked from the warm launcher, with what ``launcher.local`` asks of a Popen."""

    def __init__(self, cmd, env, stdout, stderr, logging_state: dict) -> None:
        self.args, self.returncode = cmd, None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            self._become(cmd, env, stdout, stderr, logging_state)

    @staticmethod
    def _become(cmd, env, stdout, stderr, logging_state: dict) -> None:
        import random

        code = 1
        try:
            _restore_logging(logging_state)
            if stdout is not None:
                os.dup2(stdout.fileno(), 1)
            if stderr == subprocess.STDOUT:
                os.dup2(1, 2)
            os.environ.clear()
            os.environ.update(env)
            random.seed()
            code = _run_module("train", list(cmd[3:]))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
        finally:
            _exit(code)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the client (pytest's side) ---------------------------------------------------------

_server: Optional[subprocess.Popen] = None
_server_log = Path(tempfile.gettempdir()) / f"warm-server-{os.getpid()}.log"


def _connection() -> subprocess.Popen:
    """The server of this pytest process, started on first use (~10 s of imports)."""
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, PYTHONPATH=pythonpath(), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS)
        with open(_server_log, "w") as log:
            _server = subprocess.Popen([sys.executable, "-u", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, text=True, env=env, cwd=REPO)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    server.stdin.close()  # the server's loop ends at EOF
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    _server_log.unlink(missing_ok=True)


def _request(request: dict, cmd: List[str]) -> subprocess.CompletedProcess:
    server = _connection()
    with tempfile.TemporaryDirectory() as scratch:
        request.update(stdout=f"{scratch}/stdout", stderr=f"{scratch}/stderr")
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the warm server exited ({server.poll()}):\n{_server_log.read_text()[-3000:]}")
        reply = json.loads(reply)
        out, err = (Path(scratch, name).read_text() if Path(scratch, name).exists() else ""
                    for name in ("stdout", "stderr"))
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, request["timeout"], out, err)
    done = subprocess.CompletedProcess(cmd, reply["returncode"], out, err)
    done.cpu_s = reply["cpu_s"]  # CPU seconds of all its processes (user + system)
    return done


def run_module(module: str, args: List[str], cwd: Path, env: Optional[dict] = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` from ``cwd`` as ``conftest.launcher`` runs it (PYTHONPATH
    the checkout, ``env`` added), forked warm; its CompletedProcess (TimeoutExpired after
    ``timeout`` s, its processes killed)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath()}
    request = dict(kind="module", module=module, args=list(args), cwd=str(cwd), env=full_env, timeout=timeout)
    return _request(request, [sys.executable, "-m", module, *args])


def launcher(args: List[str], cwd: Path, env: Optional[dict] = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``conftest.launcher``, warm: ``python -m launcher ARGS`` and its local ranks."""
    return run_module("launcher", args, cwd, env, timeout)


def call_ranks(function: Callable, ranks: int, args: tuple, cwd: Path, env: Optional[dict] = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``function(rank, *args)`` in ``ranks`` processes at once, each forked warm (what
    ``torch.multiprocessing`` spawns, without the imports); ``function`` importable by
    module name from tests/ (a test module's)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath()}
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(tuple(args), f)
    try:
        request = dict(kind="call", function=f"{function.__module__}:{function.__name__}", args=f.name, ranks=ranks,
                       cwd=str(cwd), env=full_env, timeout=timeout)
        return _request(request, [function.__qualname__])
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.path.insert(1, TESTS)  # kept for call_ranks' functions when a child replaces sys.path[0]
    serve()
