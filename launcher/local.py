"""The embedded default: run every rank on this machine, no Slurm.

Each rank is ``python -m train RUN_DIR`` with a torchrun-style environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the path torchrun itself takes.
Rank 0 prints to the terminal; every rank also logs to ``RUN_DIR/logs/``. If one rank
fails, the others are stopped. On Linux rank 0 forks the others after its imports
(:mod:`train.harness.forked`); each still runs as its own process with its own
environment, as under torchrun.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

from slurm.env import LOCAL_FORK_ENV, LOCAL_LAUNCH_ENV
from spec.config import RunConfig
from spec.identity import TaskIdentity
from spec.layout import Layout


# Rendezvous ports of local runs: below the kernel's ephemeral range (Linux: 32768-60999),
# which every outgoing connection (gloo's among them) and every bind to port 0 draws from,
# and apart from the Slurm jobs' 25000-31999 (slurm.env.RENDEZVOUS_PORTS). A port checked free by binding it
# and closing is only reserved until rank 0's TCPStore binds it; taken from the ephemeral
# range, another process got it in between (EADDRINUSE with several local runs at once).
LOCAL_PORTS = range(15000, 25000)


def free_port() -> int:
    """A port no one listens on now, drawn at random from :data:`LOCAL_PORTS`."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOCAL_PORTS.start, LOCAL_PORTS.stop)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOCAL_PORTS.start}-{LOCAL_PORTS.stop - 1} after 200 tries")


def run_local(cfg: RunConfig, layout: Layout, run_dir: Path) -> int:
    """Start all ranks, wait, return 0 when every rank succeeded (else the first failure's code).

    Where the OS can fork, only rank 0 is started: it imports torch and the strategy's
    modules once, then forks the other ranks (:mod:`train.harness.forked`: 2.5-4 s of
    CPU saved a rank) and stops them all when one fails, as this loop does for ranks
    started one by one (where there is no fork: not Linux)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = [TaskIdentity.placed(layout, rank, "127.0.0.1", port).torchrun_vars() for rank in range(layout.world_size)]
    env = dict(os.environ, **cfg.cluster.env)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env[LOCAL_LAUNCH_ENV] = uuid.uuid4().hex  # this launch's: a late rank of a user's code knows its end
    fork = hasattr(os, "fork") and sys.platform == "linux" and len(ranks) > 1
    if fork:
        env[LOCAL_FORK_ENV] = json.dumps(ranks[1:])
    procs: List[subprocess.Popen] = []
    for rank, rank_vars in enumerate(ranks[:1] if fork else ranks):
        out = None if rank == 0 else open(logs / f"rank{rank}.out", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "train", str(run_dir)], env={**env, **rank_vars},
                                      stdout=out, stderr=subprocess.STDOUT if out else None))
        if out:
            out.close()
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return code or next((p.returncode for p in procs if p.returncode), 0)
