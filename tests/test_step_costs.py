"""What a training step sends besides the gradients it must, counted on 2
gloo ranks forked warm (tests/warm.py):

- DDP does not broadcast the RoPE buffer before every forward (``broadcast_buffers``):
  every rank computes the same table;
- HSDP all-reduces across its replicas once a step, at the last micro-batch of an
  accumulation, not at each (FSDP keeps the earlier reduce-scattered sums until then);
- FSDP casts its units' forward inputs only where it computes in another dtype than the
  parameters' (bf16), not in fp32;
- ``strategy.compile`` compiles each block once, at the training shape, and the loss.
That the steps still train like one process is tests/test_strategies.py's (its HSDP case
accumulates).

And what the loop around the step costs the host, on the trainer itself (one rank):

- the step's loss and grad norm reach the step's all-gather on the device: the host reads
  neither (``.item()``), only the gathered table, once a step;
- every step after the first runs on batches read while the step before it was queued
  (``ShardedLoader.prefetch``; page-locked on CUDA: tests/test_data.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import warm
from helpers import compose_run, trained_in_process
from launcher.local import free_port

pytestmark = pytest.mark.slow


def _engine(rank: int, world: int, port: int, cfg):
    """This rank's engine of ``cfg``, built as the trainer builds it, in a process given a
    torchrun rank's environment (``shutdown`` ends it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from spec.layout import build_layout
    from train.harness.dist import init_distributed
    from train.model import build_model
    from train.parallelize import parallelize

    return parallelize(build_model(cfg.model, "meta"), cfg, build_layout(cfg), init_distributed(120))


def count_collectives(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    """One step of one micro-batch, then one of two: the collectives each step called."""
    import torch
    import torch.distributed as dist

    from train.harness.dist import shutdown

    engine = _engine(rank, world, port, cfg)
    calls = {"all_reduce": 0, "broadcast": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    dist.all_reduce = counted("all_reduce", dist.all_reduce)
    dist._broadcast_coalesced = counted("broadcast", dist._broadcast_coalesced)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=g)
    micro = (batch[:, :-1], batch[:, 1:])
    steps = []
    for n in (1, 2):
        before = dict(calls)
        engine.train_step([micro] * n, 1e-3)
        steps.append({k: calls[k] - before[k] for k in calls})
    Path(out_dir, f"{rank}.json").write_text(json.dumps(steps))
    shutdown()


def casts_forward_inputs(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    """Two steps under torch.profiler: whether FSDP cast any unit's forward inputs."""
    import torch

    from train.harness.dist import shutdown

    engine = _engine(rank, world, port, cfg)
    batch = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(rank))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            engine.train_step([(batch[:, :-1], batch[:, 1:])], 1e-3)
    names = {e.name for e in prof.events()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(
        [{"casts": "FSDP::cast_forward_inputs" in names, "gathers": "FSDP::all_gather" in names}]))
    shutdown()


def compiles_once(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    """Build (DDP settles its buckets) and three steps with dynamo's recompiles made errors."""
    import torch
    import torch._dynamo

    from train.harness.dist import shutdown

    torch._dynamo.config.error_on_recompile = True
    engine = _engine(rank, world, port, cfg)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
    losses = [float(engine.train_step([(batch[:, :-1], batch[:, 1:])], 1e-3)[0]) for _ in range(2)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        losses.append(float(engine.train_step([(batch[:, :-1], batch[:, 1:])], 1e-3)[0]))
    eager = sorted({e.name for e in prof.events() if "softmax" in e.name or "nll_loss" in e.name})
    Path(out_dir, f"{rank}.json").write_text(json.dumps([{"losses": losses, "eager_loss_ops": eager}]))
    shutdown()


def _steps(tmp_path: Path, overrides: list, function=count_collectives) -> list:
    cfg = compose_run(["cluster.gpus_per_node=1", "cluster.nodes=2", "train.seq_len=16", *overrides])
    proc = warm.call_ranks(function, 2, (2, free_port(), cfg, str(tmp_path)), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_ddp_broadcasts_no_buffer_before_its_forwards(tmp_path):
    for one, two in _steps(tmp_path, ["+strategy=ddp"]):
        assert one["broadcast"] == two["broadcast"] == 0, (one, two)


def test_hsdp_replicas_all_reduce_once_a_step_whatever_the_accumulation(tmp_path):
    for one, two in _steps(tmp_path, ["+strategy=hsdp"]):  # 2 replicas of 1 shard
        assert one["all_reduce"] > 0 and two["all_reduce"] == one["all_reduce"], (one, two)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_casts_forward_inputs_only_to_another_dtype(tmp_path, precision):
    """fp32 parameters computing in fp32 need no cast of each unit's inputs (FSDP's
    param_dtype would walk them every call); computing in bf16 they are cast."""
    for (step,) in _steps(tmp_path, ["+strategy=fsdp", f"strategy.mixed_precision={precision}"], casts_forward_inputs):
        assert step == {"casts": precision == "bf16", "gathers": True}, step


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_blocks_and_loss_are_compiled_once(tmp_path, strategy):
    """strategy.compile: each block compiles at the training shape and never again (DDP's
    bucket settling runs eagerly: compiled at its own small shape, the blocks would compile
    again for the steps, with dynamic sizes); the loss runs compiled too (no eager
    log-softmax or NLL op in a step's profile), as torchtitan's."""
    for (step,) in _steps(tmp_path, [f"+strategy={strategy}", "strategy.compile=true"], compiles_once):
        assert len(step["losses"]) == 3 and step["eager_loss_ops"] == [], step


def train_watching_reads(rank: int, run_dir: str, out: str) -> None:
    """The trainer in this process; the loss and grad norm each step returns are marked, and
    any host read of a marked tensor recorded, as is whether the loader's batches were read ahead."""
    import torch

    from train.data.loader import ShardedLoader
    from train.main import run
    from train.strategies import base

    seen = {"reads": [], "read_ahead": []}
    real_step = base.TorchEngine.train_step

    def train_step(self, *args, **kwargs):
        loss, norm = real_step(self, *args, **kwargs)
        loss.sto_watched, norm.sto_watched = "loss", "grad_norm"
        return loss, norm

    def watching(name, real):
        def read(self, *args, **kwargs):
            if getattr(self, "sto_watched", None):
                seen["reads"].append(f"{self.sto_watched}.{name}")
            return real(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__float__", "cpu", "numpy"):
        setattr(torch.Tensor, name, watching(name, getattr(torch.Tensor, name)))
    real_next = ShardedLoader.next_step

    def next_step(self):
        seen["read_ahead"].append(self._ahead is not None and self._ahead[0] == self.state.samples)
        return real_next(self)

    base.TorchEngine.train_step = train_step
    ShardedLoader.next_step = next_step
    code = run(run_dir)
    Path(out).write_text(json.dumps({"code": code, **seen}))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_host_reads_a_step_once_and_its_batches_ahead(tmp_path, strategy):
    out, rows, _ = trained_in_process(tmp_path, train_watching_reads, [f"+strategy={strategy}", "train.steps=4"])
    assert out == {"code": 0, "reads": [], "read_ahead": [False, True, True, True]}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the values still reach the metrics
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)


def train_with_a_slow_metrics_file(rank: int, run_dir: str, out: str) -> None:
    """The trainer in this process, each metrics.jsonl append taking 0.3 s (a shared
    filesystem's round trips, exaggerated); what metrics.jsonl held at each checkpoint."""
    import time

    from train.checkpoint import Checkpointer
    from train.harness import run as harness_run
    from train.main import run

    real_append, real_save = harness_run.append_metrics, Checkpointer.save
    at_save = {}

    def slow_append(*args, **kwargs):
        time.sleep(0.3)
        return real_append(*args, **kwargs)

    def save(self, engine, step, *args, **kwargs):
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        at_save[step] = [json.loads(line)["step"] for line in lines]
        return real_save(self, engine, step, *args, **kwargs)

    harness_run.append_metrics, Checkpointer.save = slow_append, save
    code = run(run_dir)
    Path(out).write_text(json.dumps({"code": code, "at_save": at_save}))


def test_a_slow_metrics_file_does_not_hold_the_steps_and_a_checkpoint_has_its_rows(tmp_path):
    out, rows, _ = trained_in_process(tmp_path, train_with_a_slow_metrics_file,
                                    ["train.steps=6", "checkpoint.every_steps=3"])
    assert out["code"] == 0
    assert out["at_save"] == {"3": [1, 2, 3], "6": [1, 2, 3, 4, 5, 6]}  # flushed before each checkpoint
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # Each row is stamped as its step ends: steps 4 and 5 followed one another without waiting
    # for the 0.3 s writes (the first row is written at once; a checkpoint waits for the rows)
    assert rows[4]["time"] - rows[3]["time"] < 0.2, [r["time"] for r in rows]
