"""One maths for every engine: in bf16, DDP (autocast over fp32
weights), FSDP (bf16 parameters, fp32 shards and gradient reduction) and DeepSpeed ZeRO-2
and ZeRO-3 (bf16 parameters, fp32 master partition, gradients reduced in fp32 by
``communication_data_type``) train the same 2-rank run to the same losses within bf16's
precision: each step's loss within 2% of DDP's (bf16 keeps 8 bits of mantissa, about
0.4% a rounding; five steps of a few hundred thousand parameters stay far inside 2%).
The fp32 runs of every strategy match one process to 1e-4: tests/test_strategies.py."""
from __future__ import annotations

import os

import pytest

from conftest import REPO, run_dir_of
from spec.rundir import read_metrics, read_run_json
from warm import launcher

pytestmark = pytest.mark.slow
COMMON = ["train.steps=5", "train.seq_len=32", "data.num_tokens=50000", "optim.grad_clip=0.5",
          "strategy.mixed_precision=bf16", "cluster.gpus_per_node=2", "train.micro_batch_size=4"]
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
TOLERANCE = 0.02


def test_every_engine_trains_the_same_bf16_run(tmp_path):
    losses = {}
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        proc = launcher([f"+strategy={strategy}", *COMMON, f"data.cache_dir={tmp_path}/d"], cwd=tmp_path, env=ENV,
                        timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run = run_dir_of(proc.stdout)
        assert read_run_json(run)["status"] == "completed"
        losses[strategy] = [r["loss"] for r in read_metrics(run)]
    reference = losses.pop("ddp")
    assert len(reference) == 5 and reference[-1] < reference[0]
    for strategy, got in losses.items():
        worst = max(abs(a - b) / abs(a) for a, b in zip(reference, got))
        print(f"bf16 parity: {strategy} within {worst:.2%} of ddp")
        assert len(got) == 5 and worst <= TOLERANCE, (strategy, reference, got)
