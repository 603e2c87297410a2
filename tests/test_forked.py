"""Local ranks forked by rank 0 (train/harness/forked.py): each child is its rank, with its
own environment and output file; a failing child stops the others and gives rank 0's
exit status; signals to rank 0 reach the children. Each case runs in a fresh Python
process (forking pytest itself would copy its state)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO
from warm import pythonpath

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from train.harness.forked import fork_ranks

run_dir = sys.argv[1]
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))

def entry():
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}", flush=True)
    return CHILD(rank)

ranks = fork_ranks(run_dir, entry, lambda d: Path(d, "warmed").write_text("yes"))
code = RANK0(ranks, got)
print("rank0 exit", ranks.finish(code), "signals", sorted(set(got)), flush=True)
"""


def run(tmp_path: Path, child: str, rank0: str, world: int = 3, timeout: float = 60) -> subprocess.CompletedProcess:
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)} for r in range(1, world)]
    script = SCRIPT.replace("CHILD(rank)", f"({child})(rank)").replace("RANK0(ranks, got)", f"({rank0})(ranks, got)")
    env = dict(os.environ, PYTHONPATH=pythonpath(), STO_LOCAL_FORK=json.dumps(envs))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def out(tmp_path: Path, rank: int) -> str:
    return (tmp_path / "logs" / f"rank{rank}.out").read_text()


def test_children_are_their_ranks_and_all_succeed(tmp_path):
    proc = run(tmp_path, "lambda r: 0", "lambda ranks, got: 0")
    assert proc.returncode == 0, proc.stderr
    assert "rank0 exit 0 signals []" in proc.stdout
    assert (tmp_path / "warmed").read_text() == "yes"  # the workload's imports ran before the fork
    assert out(tmp_path, 1).strip() == "rank 1 of 3 local 1" and out(tmp_path, 2).strip() == "rank 2 of 3 local 2"


def test_a_failing_child_stops_the_others_and_is_rank0s_status(tmp_path):
    # rank 1 fails at once; rank 2 would sleep for a minute (SIGTERM ends it); rank 0 waits to be told
    child = "lambda r: 3 if r == 1 else (signal.signal(signal.SIGTERM, signal.SIG_DFL), time.sleep(60))"
    rank0 = "lambda ranks, got: [time.sleep(0.05) for _ in range(400) if not got] and 0"
    proc = run(tmp_path, child, rank0)
    assert proc.returncode == 0, proc.stderr
    assert f"rank0 exit 3 signals [{int(__import__('signal').SIGTERM)}]" in proc.stdout, proc.stdout + proc.stderr
    assert "rank 1 exited with status 3: stopping the other ranks" in proc.stderr


def test_signals_to_rank0_reach_the_children(tmp_path):
    child = ("lambda r: (signal.signal(signal.SIGUSR2, lambda s, f: (print('child got USR2', flush=True), "
             "os._exit(0))), time.sleep(30), 5)[-1]")
    rank0 = "lambda ranks, got: (time.sleep(1.0), os.kill(os.getpid(), signal.SIGUSR2), time.sleep(0.2), 0)[-1]"
    proc = run(tmp_path, child, rank0)
    assert proc.returncode == 0, proc.stderr
    assert f"rank0 exit 0 signals [{int(__import__('signal').SIGUSR2)}]" in proc.stdout, proc.stdout + proc.stderr
    assert "child got USR2" in out(tmp_path, 1) and "child got USR2" in out(tmp_path, 2)


def test_children_die_with_rank0(tmp_path):
    child = "lambda r: (Path(sys.argv[1], f'pid{r}').write_text(str(os.getpid())), time.sleep(60))"  # ignores TERM
    rank0 = "lambda ranks, got: (time.sleep(1.0), os._exit(9))"
    proc = run(tmp_path, child, rank0)
    assert proc.returncode == 9
    for r in (1, 2):
        pid = int((tmp_path / f"pid{r}").read_text())
        deadline = __import__("time").time() + 10
        while Path(f"/proc/{pid}").exists() and __import__("time").time() < deadline:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
            if state == "Z":
                break
            __import__("time").sleep(0.1)
        alive = Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] not in "ZX"
        assert not alive, f"rank {r} (pid {pid}) outlived rank 0"
