"""The logits stay sharded over the vocabulary under tensor parallel, on a pipeline's last
stage too: 2 gloo ranks build the last stage of a 2-stage split (its layer, the final norm,
the head) with the TP plan train/parallelize.py picks for pp_fsdp_tp, feed it their sequence shards of the
hidden states (as a pipeline stage receives them), and check that the head's output is a
DTensor sharded over the vocabulary, each rank holding vocab / 2 columns, and that the
loss and the head's gradient equal the whole model's, computed on one rank."""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from launcher.local import free_port


def _rank(rank: int, world: int, port: int, root: str, vocab_parallel: bool) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from spec.config import ModelConfig
    from train.model import build_model, materialise
    from train.strategies.base import loss_fn
    from train.strategies.pp import stage_module
    from train.strategies.tp import apply_tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    cfg = ModelConfig()  # tiny: 2 layers, vocab 256
    whole = build_model(cfg, "cpu")
    whole.init_weights(seed=0, device=torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, :5] = -100  # positions without loss (chat prompts): ignored by both losses
    h = whole.layers["0"](whole.tok_embeddings(tokens), whole.rope).detach()  # what stage 0 sends
    reference = F.cross_entropy(whole(tokens).flatten(0, 1), targets.flatten(0, 1))
    reference.backward()

    last = stage_module(build_model(cfg, "meta"), [1], first=False, last=True)
    apply_tp(last, init_device_mesh("cpu", (world,)), vocab_parallel=vocab_parallel)
    materialise([last], seed=0, device=torch.device("cpu"))
    logits = last(h.chunk(world, dim=1)[rank])  # this rank's sequence shard
    loss = loss_fn(logits, targets)
    loss.backward()
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
    assert logits.to_local().shape == (2, 16, cfg.vocab_size // world)
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-5, atol=1e-5)
    grad = last.output.weight.grad.full_tensor()
    torch.testing.assert_close(grad, whole.output.weight.grad, rtol=1e-4, atol=1e-6)
    Path(root, f"done{rank}").write_text("ok")
    from train.harness.dist import shutdown

    shutdown()  # barrier first: a gloo group torn down with work in flight can abort the process


@pytest.mark.slow
def test_last_pipeline_stage_keeps_the_logits_sharded(tmp_path):
    from helpers import compose_run
    from spec.layout import build_layout
    from train.parallelize import keeps_logits_sharded

    layout = build_layout(compose_run(["+strategy=pp_fsdp_tp", "cluster.gpus_per_node=4"]))
    assert layout.pp == 2 and layout.tp == 2
    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path), keeps_logits_sharded(layout)), nprocs=2,
                       start_method="spawn")
    assert [(tmp_path / f"done{r}").read_text() for r in range(2)] == ["ok", "ok"]
