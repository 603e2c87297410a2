"""File and metadata work per job is linear in the world size W, shown at W = 512 and 4,096
in one process: each simulated rank calls what its rank would, rank 0's broadcast object
handed to the others (the fake process group answers a broadcast locally, so a rank other
than 0 would receive nothing; rank 0's own call goes through it).

A counter on ``os.stat``, ``os.lstat``, ``os.open``, ``open``/``io.open`` (pathlib's
``open``), ``os.scandir``, ``os.listdir`` (pathlib's ``glob``, ``iterdir``, ``stat``,
``is_file`` go through these), ``os.replace`` and ``os.rename`` counts the calls on paths
under the test's directory, over every simulated rank of a job:

- a restore (``Checkpointer._load_latest``'s file work for one good checkpoint of 2W+1
  files: W DCP data files, W ``extra_rank{R}.pt``, ``.metadata``): rank 0's listing of
  the checkpoints, its survey (manifest, sizes), used by ``verify``, the DCP backend's
  ``load`` and ``_extra`` (the saving run's shape), each rank's checksums of its share,
  its readahead of the DCP files it loads, its read of its extra state. DCP's own reads
  inside ``dcp.load`` are not simulated (each rank reads ``.metadata`` and the data it
  needs: O(1) files a rank);
- a blocking save's commit (``Checkpointer._commit_now`` on every rank, once each rank
  wrote its files and its side file ``.crc_rank{R}.json``: O(1) calls a rank, not
  counted): rank 0's listing of the temporary directory and read of the W side files,
  each rank's read-back of its share of the files no rank summed (DCP's ``.metadata``),
  rank 0's manifest, rename and ``latest``;
- a failure's classification on every rank after a communication error, W heartbeats;
- a hang's report (``Watchdog._hang`` on every rank: its stacks, its last beat, the
  report of the stuck ranks), W = 512 (each rank parses the report of W beats: CPU).

Measured before this change, at W = 512: 3,152,902 calls for the restore (~6,158 W: every
rank stated every file about 6 times and read the manifest 3 times) and 262,144 (= W^2)
for the classification (every rank read every heartbeat), 264,705 for the hang report
(the same). Now (see the asserts): the restore about 7 W, the classification about 3 W,
at both sizes, the hang report about 7 W, under C = 8 each. The restore's survey is
since made once (rank 0 parsed the manifest three times): about 6 W.

The save's commit, measured before it changed, at W = 512: 1,055,251 calls (~2,061 W:
every rank read every side file, listed the directory and stated every file, ~4 W^2).
Now: W + 15 (rank 0 alone reads the side files), under C_SAVE = 2 W at both sizes.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, List

import pytest
import torch.distributed as dist

from train.checkpoint import manager, manifest
from train.checkpoint.backend import DCPBackend
from train.checkpoint.dcp_reader import readahead
from train.checkpoint.manager import Checkpointer
from train.checkpoint.manifest import committed_steps, owners, saved_shape, share, shared_survey, survey, verify
from train.harness import classify
from train.harness.classify import classify_failure, judge, read_beats
from train.harness.watchdog import Watchdog
from train.torch_compat import fake_process_group

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# the call counter and the fake checkpoint and heartbeats, as bench/scale.py measures them
from bench.scale import DEAD_NODE, RANKS_PER_NODE, counting, fake_checkpoint, heartbeats  # noqa: E402

C = 8  # calls per rank per job, for each of the restore and the classification
C_SAVE = 2  # calls per rank per save
def restore_as(ckpt: Path, rank: int, world: int, found) -> None:
    """One rank's file work of a restore; ``found``: rank 0's survey, broadcast."""
    backend = DCPBackend(rank)
    if rank == 0:  # Checkpointer._load_latest: stale saves, the committed steps
        list(ckpt.parent.glob(".tmp-step_*"))
        committed_steps(ckpt.parent)
    assert verify(ckpt, rank, world, backend.summed_on_load, found) is None
    owned = backend.owned(found)  # DCPBackend.load, before dcp.load
    assert owned == {rel[4:]: [size, crc] for rel, size, crc in found.shares[rank] if rel.endswith(".distcp")}
    assert f"__{rank}_0.distcp" in owned  # DCP's file of writer rank R: loaded and summed by rank R
    thread = readahead([ckpt / "dcp" / name for name in owned])
    if thread is not None:
        thread.join()
    # Checkpointer._extra: the saving run's shape is the survey's; state.load_extra opens this rank's file
    with open(ckpt / f"extra_rank{rank}.pt", "rb"):
        pass


@pytest.fixture
def no_wait(monkeypatch):
    monkeypatch.setattr(classify.time, "sleep", lambda s: None)  # the three heartbeats' wait


@pytest.mark.parametrize("world", [512, 4096])
def test_a_restore_and_a_failure_cost_each_rank_a_few_calls(tmp_path, world, no_wait):
    ckpt = fake_checkpoint(tmp_path, world)
    with counting(tmp_path) as calls:
        fake_process_group(0, world)
        try:
            found = shared_survey(ckpt, 0, world)  # rank 0's look, through the broadcast
        finally:
            dist.destroy_process_group()
        for rank in range(world):
            restore_as(ckpt, rank, world, found)
    restore = sum(calls.values())
    assert len(found.shares) == world and sum(map(len, found.shares)) == 2 * world + 1
    assert saved_shape(ckpt) == found.shape == {"world_size": world}
    heartbeats(tmp_path, world, time.time())
    with counting(tmp_path) as calls:
        verdicts = [classify_failure(tmp_path, world, 1.0, segment=3) for _ in range(world)]
    classified = sum(calls.values())
    dead = list(range(DEAD_NODE * RANKS_PER_NODE, (DEAD_NODE + 1) * RANKS_PER_NODE))
    assert verdicts[0] == {"failure": "node_failure", "dead_ranks": dead, "suspect_nodes": [f"n{DEAD_NODE}"],
                           "dead_hosts": [f"n{DEAD_NODE}"]}
    assert all(v == verdicts[0] for v in verdicts)
    print(f"W={world}: restore {restore} calls ({restore / world:.2f} W), "
          f"classification {classified} ({classified / world:.2f} W)")
    assert restore <= C * world and classified <= C * world


def fake_save(root: Path, world: int, unsummed: int = 1) -> Dict[str, List[int]]:
    """A blocking save's temporary directory once every rank wrote: its DCP data file and
    ``extra_rank{R}.pt``, their entries in its side file; ``unsummed`` files summed by no
    rank (DCP's ``.metadata``, then DeepSpeed-like files of several sizes). Every file's
    real entry, by path."""
    tmp = root / "checkpoints" / ".tmp-step_00000004"
    (tmp / "dcp").mkdir(parents=True)
    files = {}
    for r in range(world):
        mine = {}
        for rel, data in ((f"dcp/__{r}_0.distcp", b"d" * (8 + r % 5)), (f"extra_rank{r}.pt", b"x%d" % r)):
            (tmp / rel).write_bytes(data)
            mine[rel] = [len(data), zlib.crc32(data)]
        (tmp / f"{manifest.SUMS}{r}.json").write_text(json.dumps(mine))
        files.update(mine)
    for i, rel in enumerate(["dcp/.metadata"] + [f"deepspeed/f{i}.pt" for i in range(1, unsummed)]):
        (tmp / rel).parent.mkdir(exist_ok=True)
        (tmp / rel).write_bytes(b"meta" * (9 + i))
        files[rel] = [4 * (9 + i), zlib.crc32(b"meta" * (9 + i))]
    return files


def commit_all(root: Path, world: int, monkeypatch) -> None:
    """Every rank's ``Checkpointer._commit_now`` (rank 0 last: it publishes after the
    others' barrier), rank 0's plan handed to the others as its broadcast would."""
    tmp = root / "checkpoints" / ".tmp-step_00000004"
    fake_process_group(0, world)
    try:
        plan = manifest.shared_save_plan(tmp, 0, world)  # rank 0's look, through the broadcast
        monkeypatch.setattr(manager, "shared_save_plan", lambda t, rank, w: plan if rank == 0 else ({}, plan[1]))
        for rank in [*range(1, world), 0]:
            Checkpointer(tmp.parent, rank, shape={"world_size": world})._commit_now(tmp, tmp.parent / "step_00000004", 4)
    finally:
        dist.destroy_process_group()


def committed(root: Path) -> dict:
    ckpt = root / "checkpoints" / "step_00000004"
    assert (root / "checkpoints" / manifest.LATEST).read_text() == "step_00000004\n"
    assert not list(ckpt.glob(manifest.SUMS + "*")) and not (root / "checkpoints" / ".tmp-step_00000004").exists()
    return json.loads((ckpt / manifest.MANIFEST).read_text())


@pytest.mark.parametrize("world", [512, 4096])
def test_a_save_commit_costs_each_rank_a_few_calls(tmp_path, world, monkeypatch):
    files = fake_save(tmp_path, world)
    with counting(tmp_path) as calls:
        commit_all(tmp_path, world, monkeypatch)
    content = committed(tmp_path)
    assert content["files"] == files and content["step"] == 4 and content["shape"] == {"world_size": world}
    print(f"W={world}: save commit {sum(calls.values())} calls ({sum(calls.values()) / world:.2f} W) {dict(calls)}")
    assert sum(calls.values()) <= C_SAVE * world


def test_files_no_rank_summed_are_read_back_by_the_ranks_given_them(tmp_path, monkeypatch):
    """Shared out by rank 0's plan: each rank reads back its share and leaves its entries
    for rank 0, which alone reads them and the side files; the manifest as before."""
    world = 4
    files = fake_save(tmp_path, world, unsummed=7)
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000004"
    unsummed = {"dcp/.metadata", *(f"deepspeed/f{i}.pt" for i in range(1, 7))}
    written, shares = manifest.save_plan(tmp, world)
    assert written == {rel: entry for rel, entry in files.items() if rel not in unsummed}
    assert sorted(rel for mine in shares.values() for rel in mine) == sorted(unsummed)
    assert sorted(shares) == list(range(world))  # every rank was given some
    commit_all(tmp_path, world, monkeypatch)
    assert committed(tmp_path)["files"] == files


def old_share(sizes, rank, world):
    """The split as it was written before (a linear scan for the least loaded rank)."""
    load, mine = [0] * world, []
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        match = manifest.DCP_FILE.search(path.rpartition("/")[2])
        owner = int(match.group(1)) % world if match else load.index(min(load))
        load[owner] += sizes[path]
        if owner == rank:
            mine.append(path)
    return mine


def test_the_files_are_shared_out_as_before(tmp_path):
    import random

    rng = random.Random(5)
    for world in (1, 2, 3, 7, 16):
        sizes = {f"dcp/__{r}_0.distcp": rng.choice([0, 5, 9, 9, 40]) for r in range(rng.randint(1, 2 * world))}
        sizes.update({f"extra_rank{r}.pt": rng.choice([0, 3, 3, 7, 100]) for r in range(world + 3)})
        sizes["dcp/.metadata"] = 9
        owner = owners(sizes, world)
        for rank in range(world):
            assert [p for p, r in owner.items() if r == rank] == old_share(sizes, rank, world)
    ckpt = fake_checkpoint(tmp_path, 5)
    paths = [ckpt / rel for rel in manifest.manifest_files(ckpt)]
    mine = share(paths, 3, 4)
    assert [str(p.relative_to(ckpt)) for p in mine] == old_share(
        {str(p.relative_to(ckpt)): p.stat().st_size for p in paths}, 3, 4)


def test_a_bad_checkpoint_gives_every_rank_the_same_answer_as_before(tmp_path):
    """Rank 0 finds a missing or truncated file for everyone (the message of a single-rank
    verify); a flipped byte is found by the rank whose share holds the file, and only it."""
    world = 6
    ckpt = fake_checkpoint(tmp_path, world)
    victim = ckpt / "extra_rank2.pt"
    data = victim.read_bytes()
    victim.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    found = survey(ckpt, world)
    owner = next(r for r in range(world) if any(rel == "extra_rank2.pt" for rel, _, _ in found.shares[r]))
    answers = [verify(ckpt, r, world, found=found) for r in range(world)]
    assert answers == [("checksum mismatch in extra_rank2.pt" if r == owner else None) for r in range(world)]
    assert verify(ckpt) == "checksum mismatch in extra_rank2.pt"
    victim.write_bytes(data[:1])
    assert survey(ckpt, world).reason == verify(ckpt) == f"truncated file extra_rank2.pt (1 of {len(data)} bytes)"
    victim.unlink()
    assert survey(ckpt, world).reason == verify(ckpt) == "missing file extra_rank2.pt"
    (ckpt / manifest.MANIFEST).write_text("{")
    assert verify(ckpt, 1, world, found=survey(ckpt, world)).startswith("unreadable manifest (")
    (ckpt / manifest.MANIFEST).unlink()
    assert verify(ckpt, 4, world, found=survey(ckpt, world)) == "no commit marker"


def test_the_verdict_is_read_once_else_each_rank_reads_the_beats_itself(tmp_path, no_wait, monkeypatch):
    """The first rank's verdict is the others' (the same as each would have judged); a
    verdict that never comes (its reader died after taking the lock) or an old one (another
    failure's): each rank reads the heartbeats itself, after a bounded wait."""
    world = 32
    heartbeats(tmp_path, world, time.time())
    mine = judge(read_beats(tmp_path, world), time.time(), 1.0)
    assert mine["failure"] == "node_failure" and mine == classify_failure(tmp_path, world, 1.0)
    assert [classify_failure(tmp_path, world, 1.0, segment=5) for _ in range(3)] == [mine] * 3
    assert (tmp_path / "heartbeat" / "classified-5.json").is_file()
    monkeypatch.setattr(classify, "CLASSIFY_WAIT_S", 0.0)
    (tmp_path / "heartbeat" / ".classify-6").touch()  # taken, never answered
    with counting(tmp_path) as calls:
        assert classify_failure(tmp_path, world, 1.0, segment=6) == mine
    assert sum(calls.values()) > world  # read by itself
    old = {"time": time.time() - 3600, "verdict": {"failure": "communication"}}
    (tmp_path / "heartbeat" / "classified-6.json").write_text(json.dumps(old))
    assert classify_failure(tmp_path, world, 1.0, segment=6) == mine


def test_a_hang_is_reported_from_one_reading_of_the_heartbeats(tmp_path, no_wait, monkeypatch):
    """Every rank sees the hang; the first reads the heartbeats and writes hang.json, the
    others record its report."""
    world = 512
    heartbeats(tmp_path, world, time.time())
    exits, reports = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    with counting(tmp_path) as calls:
        for rank in range(world):
            Watchdog(tmp_path, rank, rank // RANKS_PER_NODE, f"n{rank // RANKS_PER_NODE}", world, timeout_s=5,
                     segment=2, on_hang=reports.append)._hang()
    written = json.loads((tmp_path / "hang.json").read_text())
    assert written["detected_by"] == 0 and written["stuck_ranks"] == [0]  # its own beat: "startup"
    assert exits == [75] * world and all(r == written for r in reports)
    print(f"W={world}: hang report {sum(calls.values())} calls")
    assert sum(calls.values()) <= C * world
