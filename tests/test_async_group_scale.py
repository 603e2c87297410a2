"""The async save's group (train/checkpoint/async_save.py ``coordination_group``) at scale:
made for one rank of a 4,096-rank job on the fake process group; on gloo its pairs connect
at first use, not all at once (a full mesh is W - 1 sockets a rank); and gloo's interface
toward the master (train/harness/dist.py ``gloo_interface_default``)."""
from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.local import free_port
from train.checkpoint.async_save import GLOO_LAZY_INIT, AsyncSaver, coordination_group
from train.harness.dist import gloo_interface_default

from conftest import FAKE_WORLD as WORLD  # noqa: E402


def test_prepare_at_4096_ranks_on_the_fake_backend(fake_world):
    saver = AsyncSaver()
    saver.prepare()
    try:
        group = saver._group
        assert dist.get_backend(group) == "fake" and group.size() == WORLD and group.rank() == WORLD - 1
        saver.prepare()  # once a run
        assert saver._group is group
    finally:
        saver.close()


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop(GLOO_LAZY_INIT, None)
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    before = _sockets()
    group = coordination_group()
    made = _sockets() - before
    dcp.save({"x": torch.full((4,), float(rank))}, checkpoint_id=out, process_group=group)  # works lazily
    Path(out, f"rank{rank}.json").write_text(json.dumps({"made": made, "env": os.environ.get(GLOO_LAZY_INIT)}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc")
def test_gloo_group_connects_no_pair_when_made(tmp_path):
    world = 3  # a full mesh: 2 pairs and a listening socket a rank as the group is made
    mp.start_processes(_rank, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="spawn")
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"made": 1, "env": None}, (rank, got)  # its listening socket; the variable not left set
    assert (tmp_path / ".metadata").exists()


def test_gloo_interface_toward_the_master():
    env = {}
    if "lo" in {name for _, name in socket.if_nameindex()}:
        assert gloo_interface_default("127.0.0.1", multi_node=False, env=env) == "lo"
        assert env == {"GLOO_SOCKET_IFNAME": "lo"}
    assert gloo_interface_default("127.0.0.1", multi_node=True, env={}) is None  # a loopback for several nodes
    given = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert gloo_interface_default("127.0.0.1", multi_node=False, env=given) is None and given == {
        "GLOO_SOCKET_IFNAME": "ib0"}
