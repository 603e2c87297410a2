"""Float8 training (``strategy.float8``): which Linears are converted and where it runs.

Pure (no torch, no torchao): the launcher refuses what cannot run before submission
(:func:`check_float8` from :func:`spec.validate.validate`, :func:`check_float8_layout`
from :func:`spec.support.check_supported`), the planner counts the converted Linears
(:func:`converted_params`), and the trainer converts exactly the Linears
:func:`skip_reason` passes (train/float8.py, torchao's ``convert_to_float8_training``).

The rules are torchtitan's (``torchtitan/components/quantization``): a Linear is left in
bf16 when its name contains one of ``strategy.float8_skip`` (its ``filter_fqns``; the
output head by default) or when its in or out features are not multiples of 16 (the
float8 matmul's requirement); here also a head tied to the embedding (converting it
would give it a weight of its own).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from spec.config import ConfigError, ModelConfig, RunConfig
from spec.model_size import ffn_hidden_dim, head_dim

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)   # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
MULTIPLE = 16             # in and out features of a float8 matmul
TIED = "tied to the embedding"
NOT_16 = f"in or out features not multiples of {MULTIPLE}"
SKIPPED = "strategy.float8_skip"


def skip_reason(name: str, in_features: int, out_features: int, skip: Sequence[str],
                tied: bool = False) -> Optional[str]:
    """Why the Linear ``name`` stays in bf16 (None: it is converted)."""
    if tied:
        return TIED
    hit = next((s for s in skip if s and s in name), None)
    if hit is not None:
        return f"{SKIPPED} ({hit!r})"
    if in_features % MULTIPLE or out_features % MULTIPLE:
        return NOT_16
    return None


def block_linears(m: ModelConfig) -> List[Tuple[str, int, int]]:
    """(name inside a block, in features, out features) of one block's Linears, as
    train/model.py builds them."""
    q, kv, f = m.n_heads * head_dim(m), (m.n_kv_heads or m.n_heads) * head_dim(m), ffn_hidden_dim(m)
    return [("attention.wq", m.dim, q), ("attention.wk", m.dim, kv), ("attention.wv", m.dim, kv),
            ("attention.wo", q, m.dim), ("feed_forward.w1", m.dim, f), ("feed_forward.w2", f, m.dim),
            ("feed_forward.w3", m.dim, f)]


def linears(m: ModelConfig) -> List[Tuple[str, int, int]]:
    """Every Linear of the model, by its name in the model (``layers.3.attention.wq``, ``output``)."""
    out = [(f"layers.{i}.{name}", i_f, o_f) for i in range(m.n_layers) for name, i_f, o_f in block_linears(m)]
    return out + [("output", m.dim, m.vocab_size)]


def plan(cfg: RunConfig) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(converted names, [(skipped name, why)]) of ``cfg``'s model."""
    skip, tied = cfg.strategy.float8_skip, cfg.model.tie_embeddings
    converted, skipped = [], []
    for name, i_f, o_f in linears(cfg.model):
        why = skip_reason(name, i_f, o_f, skip, tied and name == "output")
        if why is None:
            converted.append(name)
        else:
            skipped.append((name, why))
    return converted, skipped


def converted_params(cfg: RunConfig) -> Tuple[int, int]:
    """(parameters converted in the blocks, in the head) of ``cfg``'s model; (0, 0) without
    float8. Biases (Qwen2's q/k/v) stay in bf16: they are added after the matmul."""
    if not cfg.strategy.float8:
        return 0, 0
    shapes = {name: i_f * o_f for name, i_f, o_f in linears(cfg.model)}
    names = plan(cfg)[0]
    head = shapes["output"] if "output" in names else 0
    return sum(shapes[n] for n in names if n != "output"), head


def all_gather_float8(cfg: RunConfig) -> bool:
    """FSDP all-gathers the converted weights in float8 (torchao's
    ``enable_fsdp_float8_all_gather``, tensorwise scaling only): float8 under FSDP with
    ``strategy.float8_all_gather`` null or true."""
    s = cfg.strategy
    return (s.float8 and s.engine == "torch" and s.data_parallel == "fsdp" and s.float8_recipe == "tensorwise"
            and s.float8_all_gather is not False)


def capability_ok(capability: Tuple[int, int]) -> bool:
    return tuple(capability) >= MIN_CAPABILITY


def device_line(device: str, capability: Optional[Tuple[int, int]], name: str, host: str) -> Optional[str]:
    """The refusal of a task whose device cannot run float8 (None: it can): CPU, or a CUDA
    device of compute capability below 8.9."""
    if device == "cpu" or capability is None:
        return (f"strategy.float8=true on {host}: the task runs on the CPU, float8 matmuls need a GPU of compute "
                f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (H100, H200, L40S); "
                "set strategy.float8=false")
    if not capability_ok(capability):
        return (f"strategy.float8=true on {host}: {name} has compute capability {capability[0]}.{capability[1]}, "
                f"float8 matmuls need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (H100, H200, L40S); "
                "set strategy.float8=false or run on such GPUs")
    return None


def check_float8(cfg: RunConfig) -> None:
    """Raise ConfigError (field, value, fix) for a ``strategy.float8*`` this version cannot
    run, whatever the layout (:func:`check_float8_layout`: the degrees)."""
    s, c = cfg.strategy, cfg.cluster
    if s.float8_recipe not in RECIPES:
        raise ConfigError(f"strategy.float8_recipe={s.float8_recipe!r} is not a recipe of this version; use "
                          f"strategy.float8_recipe={' or '.join(RECIPES)}")
    if not s.float8:
        return
    need = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    if c.accelerator != "gpu":
        raise ConfigError(f"strategy.float8=true with cluster.accelerator={c.accelerator}: float8 matmuls need a GPU "
                          f"of compute capability {need} or later; set strategy.float8=false or use a GPU profile "
                          "(+cluster=h100x8)")
    if c.gpu_capability is not None and c.gpu_capability < MIN_CAPABILITY[0] + MIN_CAPABILITY[1] / 10 - 1e-9:
        raise ConfigError(f"strategy.float8=true on cluster {c.name!r} (cluster.gpu_capability={c.gpu_capability}): "
                          f"float8 matmuls need compute capability {need} or later (H100, H200); set "
                          "strategy.float8=false or use such a cluster")
    if s.mixed_precision == "fp32":
        raise ConfigError("strategy.float8=true with strategy.mixed_precision=fp32: the Linears not converted and "
                          "the rest of the model run in bf16; set strategy.mixed_precision=bf16 (or auto)")
    if cfg.peft.method is not None:
        raise ConfigError(f"strategy.float8=true with peft.method={cfg.peft.method}: LoRA's adapters wrap the Linears "
                          "float8 would convert; not supported together in this version: drop +peft=lora or set "
                          "strategy.float8=false")
    if s.float8_all_gather and s.float8_recipe != "tensorwise":
        raise ConfigError(f"strategy.float8_all_gather=true with strategy.float8_recipe={s.float8_recipe}: torchao "
                          "all-gathers in float8 with tensorwise scaling only; set strategy.float8_all_gather=null "
                          "or strategy.float8_recipe=tensorwise")


def check_float8_layout(cfg: RunConfig, layout) -> None:
    """Raise ConfigError for a float8 strategy this version does not run: DeepSpeed, tensor
    parallel (torchao's float8 TP plans are not wired here) and pipeline parallel."""
    s = cfg.strategy
    if not s.float8:
        return
    if s.engine != "torch":
        raise ConfigError(f"strategy.float8=true with strategy {s.name!r} (engine={s.engine}): float8 runs on the "
                          "torch engine; use +strategy=fsdp (or ddp), or strategy.float8=false")
    for field, degree in (("tensor_parallel", layout.tp), ("pipeline_parallel", layout.pp)):
        if degree != 1:
            raise ConfigError(f"strategy.float8=true with strategy.{field}={degree}: float8 runs under DDP, FSDP and "
                              f"HSDP in this version; set strategy.{field}=1 (+strategy=fsdp) or strategy.float8=false")
