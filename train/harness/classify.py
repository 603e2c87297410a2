"""After a communication error: which ranks died, did whole nodes go (:func:`classify_failure`)?

The ranks' heartbeats (``RUN_DIR/heartbeat/rank{R}.json``, written by
:class:`train.harness.watchdog.Watchdog`) tell: a rank whose beat stopped is dead. Every
rank of a job classifies the failure it sees; the heartbeats are read once for the job,
not once a rank (W files each: W squared reads at W ranks), by the first rank to take the
segment's lock, and the others take its verdict (:func:`shared_verdict`). The watchdog's
hang report is made once the same way (:func:`once`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional


def read_beats(run_dir: Path, world_size: int) -> List[Dict[str, Any]]:
    """Every rank's last heartbeat (a stand-in with step -1 for a rank that has none)."""
    beats = []
    for r in range(world_size):
        try:
            beats.append(json.loads((run_dir / "heartbeat" / f"rank{r}.json").read_text()))
        except (OSError, json.JSONDecodeError):
            beats.append({"rank": r, "phase": "unknown (no heartbeat)", "step": -1})
    return beats


def classify_failure(run_dir: Path, world_size: int, interval_s: float = 1.0, segment: Optional[int] = None
                     ) -> Dict[str, Any]:
    """After a communication error: which ranks died, and did whole nodes go?

    Live ranks keep beating every ``interval_s`` (the watchdog thread runs on while the
    main thread handles the error); a rank whose heartbeat stopped is dead. A node all of
    whose ranks are dead is a suspected node failure: resubmission excludes it. Without
    heartbeats (interval 0) nothing can be told apart: a communication failure.

    With ``segment`` (which start of the run failed) one rank reads the heartbeats for the
    job and the others take its verdict (:func:`shared_verdict`); without, this rank reads
    them all itself.
    """
    if interval_s <= 0:
        return {"failure": "communication", "dead_ranks": [], "suspect_nodes": [], "dead_hosts": []}
    started = time.time()
    time.sleep(3 * interval_s)  # let live ranks publish a fresh beat
    if segment is None:
        return judge(read_beats(run_dir, world_size), time.time(), interval_s)
    return shared_verdict(run_dir, world_size, interval_s, segment, started)


def judge(beats: List[Dict[str, Any]], now: float, interval_s: float) -> Dict[str, Any]:
    """:func:`classify_failure`'s verdict on the ranks' heartbeats ``beats`` read at ``now``. Pure."""
    dead = [b for b in beats if now - b.get("time", 0) > 2.5 * interval_s]
    gone = {id(b) for b in dead}  # each beat is one rank's: the same as ``b in dead``, in O(1)
    hosts: Dict[str, List[bool]] = {}
    for b in beats:
        hosts.setdefault(b.get("host", "?"), []).append(id(b) in gone)
    nodes = sorted(h for h, states in hosts.items() if all(states) and h != "?")
    kind = "node_failure" if nodes else ("rank_failure" if dead else "communication")
    return {"failure": kind, "dead_ranks": sorted(b["rank"] for b in dead), "suspect_nodes": nodes,
            "dead_hosts": sorted({b.get("host", "?") for b in dead} - {"?"})}


# One reader of the heartbeats per failed segment. The ranks notice a failure within a
# moment of each other (a broken connection, the same collective timeout), so the first
# to take ``heartbeat/.classify-<segment>`` reads every heartbeat and writes its verdict
# to ``heartbeat/classified-<segment>.json``; the others wait for that file (:func:`once`).
# A dead rank never takes the lock, so rank 0's death changes nothing. A verdict made more
# than VERDICT_RECENT_S before this rank began to classify is another failure's.
CLASSIFY_WAIT_S = 5.0  # + a millisecond a rank: the reader's reads at W = 4,096 on a loaded file system
VERDICT_RECENT_S = 30.0  # + 3 intervals: the step loop's grace for a failed step's tasks
POLL_S = (0.05, 1.0)  # the first and the longest pause between looks for the answer


def shared_verdict(run_dir: Path, world_size: int, interval_s: float, segment: int, started: float
                   ) -> Dict[str, Any]:
    """:func:`judge` of the heartbeats, read once for the job (see above); ``started``: when
    this rank began to classify (before its wait for fresh beats)."""
    def read() -> Dict[str, Any]:
        now = time.time()
        return {"time": now, "verdict": judge(read_beats(run_dir, world_size), now, interval_s)}

    oldest = started - VERDICT_RECENT_S - 3 * interval_s
    folder = run_dir / "heartbeat"
    return once(folder / f".classify-{segment}", folder / f"classified-{segment}.json", read,
                lambda found: found.get("time", 0) >= oldest, wait_timeout(world_size))["verdict"]


def wait_timeout(world_size: int) -> float:
    """How long the ranks wait for the one that reads every rank's file (:func:`once`)."""
    return CLASSIFY_WAIT_S + world_size / 1000


def once(lock: Path, result: Path, compute: Callable[[], Dict[str, Any]], fresh: Callable[[Dict[str, Any]], bool],
         wait_s: float) -> Dict[str, Any]:
    """``compute()`` done by one rank of a job for all: the first to create ``lock`` computes
    and writes the answer to ``result`` (atomically); the others take ``result``'s content
    once it is there and ``fresh``, polling at a backoff (a few looks each, not one a rank
    every tenth of a second), and compute it themselves only if none came in ``wait_s``
    (the first died or stalled before writing: slower, the same answer)."""
    try:
        os.close(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:  # another rank computes it: wait for its answer
        found = wait_for(result, fresh, wait_s)
        return compute() if found is None else found
    except OSError:  # nowhere to lock: compute it here
        return compute()
    answer = compute()
    tmp = result.with_name(f".{result.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(answer, indent=1))
        os.replace(tmp, result)  # a reader never sees half a file
    except OSError:  # the others wait, then compute it themselves
        pass
    return answer


def wait_for(path: Path, fresh: Callable[[Dict[str, Any]], bool], wait_s: float) -> Optional[Dict[str, Any]]:
    """``path``'s content once it is there and ``fresh``; None if not within ``wait_s``."""
    deadline, pause = time.monotonic() + wait_s, POLL_S[0]
    while True:
        try:
            found = json.loads(path.read_text())
            if isinstance(found, dict) and fresh(found):
                return found
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, POLL_S[1])
