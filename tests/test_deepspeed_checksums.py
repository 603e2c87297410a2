"""DeepSpeed's checkpoint files summed by the rank that writes them, on 2
gloo ranks forked warm (tests/warm.py), each building its engine as the trainer does:

- a save reads no checkpoint file back: every rank's DeepSpeed files are summed as they
  are written (:mod:`train.checkpoint.deepspeed_io`), so the commit has nothing left to
  read (watched with an audit hook on ``open``: any file under the checkpoints opened
  with read access during the save, but the ranks' own ``.crc_rank*.json`` side files
  and the manifest, which rank 0 writes and fsyncs through a read-only descriptor);
  and the manifest's sizes and CRCs are still the files' own (zlib, computed here);
- a byte flipped in a DeepSpeed file of the newest checkpoint is still caught before its
  load (:func:`train.checkpoint.manifest.verify`): the restore reports it ignored and
  loads the one before.
The checkpoint engine swap is refused, clearly, on a DeepSpeed engine that has not the one
it replaces."""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

import warm
from helpers import compose_run
from launcher.local import free_port

pytestmark = pytest.mark.slow
OPTIM_OF_RANK_1 = "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _engine(rank: int, world: int, port: int, cfg):
    """This rank's engine of ``cfg``, built as the trainer builds it (as tests/test_step_costs.py)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from spec.layout import build_layout
    from train.harness.dist import init_distributed
    from train.model import build_model
    from train.parallelize import parallelize

    return parallelize(build_model(cfg.model, "meta"), cfg, build_layout(cfg), init_distributed(120))


def _real_sums(ckpt: Path) -> dict:
    """Every file of a checkpoint but its manifest: [size, zlib CRC32], read here."""
    return {str(p.relative_to(ckpt)): [p.stat().st_size, zlib.crc32(p.read_bytes())]
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != "COMMITTED"}


def save_watching_reads(rank: int, world: int, port: int, cfg, out_dir: str, corrupt: bool) -> None:
    """Two saves (after steps 1 and 2), any read of a checkpoint file during them recorded;
    rank 0 then sums every committed file itself. ``corrupt``: a byte of rank 1's optimizer
    file of the newest one flipped, then the restore's reports and the step it loaded."""
    import sys

    import torch
    import torch.distributed as dist

    from spec.layout import build_layout
    from spec.rundir import run_shape
    from train.checkpoint import Checkpointer
    from train.checkpoint.manifest import MANIFEST, SUMS
    from train.harness.dist import shutdown

    engine = _engine(rank, world, port, cfg)
    root = Path(out_dir) / "checkpoints"
    prefix = str(root) + os.sep
    reads, watching = [], [False]

    def hook(event, args):
        if event != "open" or not watching[0]:
            return
        path, _, flags = args
        if not isinstance(path, (str, bytes, os.PathLike)) or flags & os.O_ACCMODE == os.O_WRONLY:
            return
        path = os.path.abspath(os.fsdecode(path))
        name = os.path.basename(path)
        if path.startswith(prefix) and not os.path.isdir(path) and not name.startswith(SUMS) and name != MANIFEST:
            reads.append(os.path.relpath(path, root))

    sys.addaudithook(hook)
    shape = run_shape(cfg, build_layout(cfg))
    ckpt = Checkpointer(root, rank, keep=2, shape=shape)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(rank))
    for step in (1, 2):
        engine.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
        watching[0] = True
        ckpt.save(engine, step, {"loader": {"samples": step}})
        ckpt.wait()  # rank 0's pruning thread (nothing to prune: keep=2)
        watching[0] = False
    out = {"reads": reads}
    if rank == 0:
        out["real"] = {p.name: _real_sums(p) for p in sorted(root.glob("step_*"))}
    if corrupt:
        if rank == 0:
            victim = root / "step_00000002" / OPTIM_OF_RANK_1
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        dist.barrier()
        said = []
        extra = Checkpointer(root, rank, keep=2, shape=shape).load_latest(engine, said.append)
        out.update(said=said, loaded=extra and extra["step"])
    Path(out_dir, f"{rank}.json").write_text(json.dumps(out))
    shutdown()


def _saved(tmp_path: Path, strategy: str, corrupt: bool = False) -> list:
    cfg = compose_run(["cluster.gpus_per_node=2", "train.seq_len=16", f"+strategy={strategy}"])
    proc = warm.call_ranks(save_watching_reads, 2, (2, free_port(), cfg, str(tmp_path), corrupt), cwd=tmp_path,
                           timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def _manifests_are_the_files(tmp_path: Path, real: dict) -> None:
    root = tmp_path / "checkpoints"
    assert sorted(real) == ["step_00000001", "step_00000002"]
    for name, files in real.items():
        listed = json.loads((root / name / "COMMITTED").read_text())["files"]
        assert listed == files, name  # the same files, sizes and CRCs
        assert {"deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt", OPTIM_OF_RANK_1} <= set(listed)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_deepspeed_save_reads_no_checkpoint_file_back(tmp_path, strategy):
    ranks = _saved(tmp_path, strategy, corrupt=strategy == "zero2")
    assert [r["reads"] for r in ranks] == [[], []]
    _manifests_are_the_files(tmp_path, ranks[0]["real"])
    if strategy == "zero2":  # the byte flipped in step 2 is caught before its load: step 1 is loaded
        assert ranks[0]["said"] == [f"checkpoint step_00000002 ignored: checksum mismatch in {OPTIM_OF_RANK_1}"]
        assert [r["loaded"] for r in ranks] == [1, 1]


def test_the_checkpoint_engine_swap_is_refused_on_another_deepspeed(tmp_path):
    from train.checkpoint.deepspeed_io import summed_files

    for ds in (SimpleNamespace(), SimpleNamespace(checkpoint_engine=object())):
        with pytest.raises(RuntimeError, match="checkpoint_engine"):
            with summed_files(ds, tmp_path):
                pass


@pytest.mark.parametrize("zipfile", [True, False])
def test_a_summed_save_is_the_files_entry_in_either_torch_save_format(tmp_path, zipfile):
    """DeepSpeed's ``checkpoint_serialization`` picks the format; the legacy one writes the
    tensors through ``write`` too (the stream has no descriptor to write them to)."""
    import torch

    from train.checkpoint.deepspeed_io import save_summed

    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
    path = tmp_path / "state.pt"
    assert save_summed(state, path, zipfile) == [path.stat().st_size, zlib.crc32(path.read_bytes())]
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
