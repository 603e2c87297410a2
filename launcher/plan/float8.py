"""What ``strategy.float8`` changes in the planner's memory and step time (pure, no torch;
docs/planner.md, "Float8"). Read in torchao 0.18's source (``torchao/float8/``):

- ``matmul_with_hp_or_float8_args.forward`` saves its input and weight for backward as
  it got them (``ctx.save_for_backward(input_hp, weight_hp_t)``) and casts both to float8
  again in backward: the activations a converted Linear keeps are a bf16 Linear's.
  Under DDP's autocast ``Float8Linear.forward`` casts only the input to bf16 and the
  matmul takes the fp32 weight itself: no bf16 copy of a converted weight is saved.
- With FSDP's float8 all-gather (``enable_fsdp_float8_all_gather``, tensorwise) each
  converted weight is gathered as float8 (``fsdp_pre_all_gather`` casts the shard, 1 byte
  an element) and stays so until FSDP frees it; the unsharded gradient stays bf16.
- The float8 copies made for each matmul (input, weight, output gradient) live for that
  matmul only: not counted.

Step time: the converted Linears' matmul FLOPs (forward and both backward matmuls: all
three run in float8 under both recipes) at :data:`FLOAT8_SPEEDUP` x the bf16 rate.
"""
from __future__ import annotations

from typing import Tuple

from spec.config import RunConfig
from spec.layout import Layout
from spec.float8 import all_gather_float8, converted_params

# float8 matmul throughput over bf16's: H100/H200 SXM datasheets, 1979 against 989 dense
# TFLOP/s. An assumption until calibrated on a GPU (bench/gpu_check_float8.py measures
# float8 against bf16 tokens/s); the casts' own passes are not counted.
FLOAT8_SPEEDUP = 2.0


def active(cfg: RunConfig, layout: Layout) -> bool:
    """The layout trains in float8: strategy.float8 on the torch engine without tensor or
    pipeline parallel (spec/float8.py refuses the others; the planner's table of every
    preset still shows them, with bf16 figures)."""
    s = cfg.strategy
    return s.float8 and s.engine == "torch" and layout.tp == 1 and layout.pp == 1


def converted(cfg: RunConfig, layout: Layout) -> Tuple[float, float]:
    """(converted parameters of one block, of the root unit: the head when converted), whole
    matrices (tp = pp = 1); (0, 0) where the layout does not train in float8."""
    if not active(cfg, layout):
        return 0.0, 0.0
    blocks, head = converted_params(cfg)
    return blocks / cfg.model.n_layers, float(head)


def converted_total(cfg: RunConfig, layout: Layout) -> float:
    block, head = converted(cfg, layout)
    return block * cfg.model.n_layers + head


def gather_saving(cfg: RunConfig, layout: Layout, e: int) -> float:
    """Bytes a converted parameter saves once gathered: e - 1 with FSDP's float8
    all-gather, else 0 (gathered in the compute dtype as before)."""
    return float(e - 1) if active(cfg, layout) and all_gather_float8(cfg) else 0.0


def effective_flops_per_token(cfg: RunConfig, layout: Layout, flops_per_token: float) -> float:
    """``flops_per_token`` counted at the bf16 rate: the converted matmuls' share (6 FLOPs a
    converted parameter and token) divided by :data:`FLOAT8_SPEEDUP`."""
    return flops_per_token - 6.0 * converted_total(cfg, layout) * (1.0 - 1.0 / FLOAT8_SPEEDUP)
