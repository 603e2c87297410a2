"""The planner beside published references: the ZeRO paper's Fig. 1, DeepSpeed's own
memory estimators (called here, from the installed deepspeed), torchtitan's published
Llama 3 memory. Prints the table docs/planner.md holds, or rewrites it there (with the
table of recommended layouts, between its own markers):

    .venv/bin/python bench/planner_refs.py [--write docs/planner.md]

``--write`` replaces what lies between the markers ``<!-- planner_refs:begin -->`` and
``<!-- planner_refs:end -->``; tests/test_planner_refs.py checks that the file holds what
this prints. Lives in bench/ because it imports deepspeed (the login side never does).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.plan.cli import compose  # noqa: E402
from launcher.plan.memory import (CUDA_OVERHEAD, OP_SAC, compute_bytes, estimate, fp32_grad_copy,  # noqa: E402
                                  model_states, stage_params, zero3_gathered)
from spec.layout import build_layout  # noqa: E402
from spec.model_size import count_params, largest_module_params  # noqa: E402

BEGIN, END = "<!-- planner_refs:begin -->", "<!-- planner_refs:end -->"
LAYOUTS_BEGIN, LAYOUTS_END = "<!-- planner_layouts:begin -->", "<!-- planner_layouts:end -->"
# (model, cluster, nodes, seq_len) of the recommendation table (one sequence per micro-batch)
LAYOUT_CASES = [(m, c, n, 8192) for m, c, n in (
    ("llama3_8b", "a100x8", 1), ("llama3_8b", "a100x8", 16), ("llama3_8b", "h100x8", 1), ("llama3_8b", "h100x8", 4),
    ("llama3_70b", "a100x8", 1), ("llama3_70b", "a100x8", 4), ("llama3_70b", "a100x8", 16),
    ("llama3_70b", "h100x8", 1), ("llama3_70b", "h100x8", 2), ("llama3_70b", "h100x8", 4),
    ("llama3_70b", "h100x8", 16), ("llama3_405b", "h100x8", 4), ("llama3_405b", "a100x8", 16),
    ("llama3_405b", "h100x8", 16))] + [(m, c, n, 2048) for m, c, n in (
        ("llama3_8b", "a100x8", 1), ("llama3_8b", "h100x8", 2), ("llama3_8b", "h100x8", 16),
        ("llama3_70b", "a100x8", 2), ("llama3_70b", "a100x8", 4), ("llama3_70b", "h100x8", 4),
        ("llama3_70b", "h100x8", 16), ("llama3_405b", "h100x8", 16))]
GB, GIB = 1e9, 2.0 ** 30
# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", Fig. 1: model states per GPU of a 7.5B model on 64 GPUs (K = 12), by stage.
ZERO_PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
PAPER_PSI, PAPER_GPUS = 7_500_000_000, 64
DS_MODELS, DS_NODES = ("llama3_1b", "llama3_8b", "llama3_70b"), (1, 2, 4, 8)
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


class Row(NamedTuple):
    source: str
    case: str
    compared: str
    reference: float
    planner: float
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.planner / self.reference


def _cfg(overrides: List[str]):
    cfg = compose(overrides)
    return cfg, build_layout(cfg)


def paper_rows() -> List[Row]:
    """Model states (params + grads + optimizer) of Ψ = 7.5e9 on 64 GPUs, bf16, by stage:
    the baseline is DDP; stage 1 with gradient accumulation (the paper's full gradients).
    The planner's states as the paper counts them: without DeepSpeed's fp32 copy of the
    gradient partition at the step, a temporary buffer (the paper's residual states), which
    the note gives."""
    rows = []
    base = ["+cluster=h100x8", f"cluster.nodes={PAPER_GPUS // 8}", "+model=llama3_8b", "strategy.mixed_precision=bf16"]
    for stage, strategy, extra in ((0, "ddp", []), (1, "zero1", ["train.grad_accum=2"]), (2, "zero2", []),
                                   (3, "zero3", [])):
        cfg, layout = _cfg([*base, f"+strategy={strategy}", *extra])
        p, g, o, *_ = model_states(cfg, layout, PAPER_PSI)
        copy = fp32_grad_copy(cfg, layout, PAPER_PSI)
        note = f"+ {copy / GB:.2f} GB at the step: {PAPER_NOTES[strategy]}" if copy else PAPER_NOTES.get(strategy, "")
        if extra:  # the same without accumulation, all of it
            one, one_layout = _cfg([*base, f"+strategy={strategy}"])
            note = note.format(sum(model_states(one, one_layout, PAPER_PSI)[:3]) / GB)
        case = f"stage {stage} ({strategy}{', grad_accum 2' if extra else ''})"
        rows.append(Row("ZeRO paper Fig. 1 (7.5B, 64 GPUs)", case, "model states", ZERO_PAPER_GB[stage],
                        (p + g + o - copy) / GB, "GB", note))
    return rows


PAPER_NOTES = {
    "zero1": ("with grad_accum 1 every micro-step is a boundary and DeepSpeed reduces the gradients as they come, as "
              "at stage 2 ({:.2f} GB with the fp32 copy)"),
    "zero2": "the fp32 copy of the gradient partition (4Ψ/N), measured",
    "zero3": "the fp32 copy of the gradient partition (whole while Ψ/N < sub_group_size), measured",
}


def deepspeed_gpu_cpu(cfg, layout) -> tuple:
    """DeepSpeed's estimator for ``cfg`` (bytes per GPU, per node on the host), called with
    additional_buffer_factor=1 (its default 1.5 pads the host figure only) and zero_init
    (without it the host figure is a start-up peak: a whole fp32 model per GPU)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    s, c, m = cfg.strategy, cfg.cluster, cfg.model
    if s.zero_stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            count_params(m), largest_module_params(m), c.gpus_per_node, c.nodes, cpu_offload=s.offload_optimizer,
            cpu_offload_params=s.offload_params, zero_init=True, additional_buffer_factor=1.0)
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(count_params(m), c.gpus_per_node, c.nodes,
                                                         cpu_offload=s.offload_optimizer, additional_buffer_factor=1.0)
    return gpu, cpu


def planner_gpu_cpu(cfg, layout) -> tuple:
    """The planner's terms DeepSpeed's estimator counts: model states on the GPU (stage 3:
    plus the largest module gathered with its gradient, DeepSpeed's 4 x largest layer) and
    the host memory per node without the gradient partition (see :func:`host_grad_partition`)."""
    psi = stage_params(cfg.model, layout.tp, layout.pp)[0]
    p, g, o, _, cpu, _ = model_states(cfg, layout, psi)
    gathered = zero3_gathered(cfg, layout, psi, compute_bytes(cfg), reuse_cache=False) if cfg.strategy.zero_stage == 3 \
        else 0.0
    return p + g + o + gathered, cpu * cfg.cluster.gpus_per_node - host_grad_partition(cfg, layout, psi)


def host_grad_partition(cfg, layout, psi: int) -> float:
    """Per node: the compute-dtype gradient partition that ZeRO-3 keeps on the host under
    optimizer offload (stage3.py allocates it on ``self.device``, the CPU), which DeepSpeed's
    estimator leaves out."""
    offloaded = cfg.strategy.zero_stage == 3 and cfg.strategy.offload_optimizer
    return compute_bytes(cfg) * psi / layout.dp * cfg.cluster.gpus_per_node if offloaded else 0.0


def deepspeed_rows() -> List[Row]:
    rows = []
    for model in DS_MODELS:
        for strategy in ("zero2", "zero3", "zero3_offload"):
            for nodes in DS_NODES:
                cfg, layout = _cfg(["+cluster=h100x8", f"cluster.nodes={nodes}", f"+model={model}",
                                    f"+strategy={strategy}", "strategy.mixed_precision=bf16"])
                ref_gpu, ref_cpu = deepspeed_gpu_cpu(cfg, layout)
                gpu, cpu = planner_gpu_cpu(cfg, layout)
                fn = "estimate_zero3" if cfg.strategy.zero_stage == 3 else "estimate_zero2"
                case = f"{model} {strategy}, {nodes} x 8 GPUs"
                rows.append(Row(f"DeepSpeed {fn}", case, "per GPU", ref_gpu / GB, gpu / GB, "GB"))
                if cfg.strategy.offload_optimizer:
                    extra = host_grad_partition(cfg, layout, stage_params(cfg.model, layout.tp, layout.pp)[0])
                    rows.append(Row(f"DeepSpeed {fn}", case, "host, per node", ref_cpu / GB, cpu / GB, "GB",
                                    f"+ {extra / GB:.2f} GB: the bf16 gradient partition stage3.py keeps on the host "
                                    "(2Ψ/N), which the estimator leaves out"))
    return rows


def torchtitan_rows() -> List[Row]:
    """torchtitan's peak reserved memory (GiB) beside the planner's total less the CUDA
    context and NCCL allowance (outside PyTorch's caching allocator, which is what
    torchtitan reads)."""
    cases = [
        ("Table 1: 8B, FSDP 8, batch 2 x 8192, selective op AC", 82.4, OP_SAC,
         ["+model=llama3_8b", "+strategy=fsdp", "train.micro_batch_size=2"], ""),
        ("Table 3: 8B, FSDP 128, batch 2 x 8192, selective op AC", 67.0, OP_SAC,
         ["+model=llama3_8b", "+strategy=fsdp", "cluster.nodes=16", "train.micro_batch_size=2"], ""),
        ("Table 4: 70B, FSDP 32 x TP 8, batch 16 x 8192, full AC", 71.9, None,
         ["+model=llama3_70b", "+strategy=fsdp_tp", "strategy.tensor_parallel=8", "cluster.nodes=32",
          "train.micro_batch_size=16", "strategy.activation_checkpointing=full"],
         "torchtitan ran it with torch.compile and Float8, which the planner does not model"),
    ]
    rows = []
    for case, gib, mode, overrides, note in cases:
        # torchtitan's loss takes whole logits (no model.loss_chunk_tokens)
        cfg, layout = _cfg(["+cluster=h100x8", "train.seq_len=8192", "strategy.mixed_precision=bf16", *overrides,
                            "model.loss_chunk_tokens=0"])
        mem = estimate(cfg, layout, mode)
        rows.append(Row(f"torchtitan ({TORCHTITAN})", case, "peak reserved", gib,
                        (mem.total_bytes - CUDA_OVERHEAD) / GIB, "GiB", note))
    return rows


# Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Section 4.2: "On
# GPT-3 175B, we reduce the VRAM consumption during training from 1.2TB to 350GB", with
# r = 4 on the query and value projections. GPT-3 175B's shape (Brown et al. 2020, Table
# 2.1: 96 layers, d_model 12288, 96 heads, 2048 tokens; 50257 tokens of vocabulary, the
# head tied to the embedding): its 4 x d_model MLP as SwiGLU's three matrices of 8/3 x
# d_model (the same 8 d_model^2 parameters a block: 174.6e9 in all).
LORA_PAPER_GB = 350.0
GPT3 = ["model.name=gpt3_175b", "model.dim=12288", "model.n_layers=96", "model.n_heads=96", "model.vocab_size=50257",
        "model.ffn_hidden_dim=32768", "model.tie_embeddings=true", "model.max_seq_len=2048", "train.seq_len=2048"]


def full_cfg_overrides() -> List[str]:
    return ["+cluster=h100x8", "cluster.nodes=8", "+strategy=zero3", "strategy.mixed_precision=bf16", *GPT3]


def lora_rows() -> List[Row]:
    """LoRA's GPT-3 175B figure: the planner's model states summed over the GPUs (ZeRO-3,
    bf16: the frozen base in 2 bytes a parameter, the adapters with their gradients, fp32
    master and Adam). Activations are not in it: the paper gives no batch for its figure,
    which the frozen weights' 2 x 174.6e9 bytes make up."""
    from spec.peft import adapter_params

    full_cfg, layout = _cfg(full_cfg_overrides())
    cfg, _ = _cfg([*full_cfg_overrides(), "+peft=lora", "peft.rank=4", "peft.target_modules=[q_proj,v_proj]"])
    psi = stage_params(cfg.model, layout.tp, layout.pp)[0]
    p, g, o, *_ = model_states(cfg, layout, psi)
    full = sum(model_states(full_cfg, layout, psi)[:3]) * layout.world_size
    note = (f"{psi / 1e9:.1f}e9 frozen + {adapter_params(cfg) / 1e6:.1f}e6 trained parameters; without LoRA the "
            f"planner counts {full / 1e12:.1f} TB (the paper's 1.2 TB names no setup to compare with); activations "
            "not counted")
    return [Row("LoRA paper Sec. 4.2 (GPT-3 175B, r=4 on q, v)", f"zero3 bf16, {layout.world_size} GPUs",
                "model states, all GPUs", LORA_PAPER_GB, (p + g + o) * layout.world_size / GB, "GB", note)]


def all_rows() -> List[Row]:
    return paper_rows() + deepspeed_rows() + torchtitan_rows() + lora_rows()


def render(rows: List[Row]) -> str:
    lines = [BEGIN, "", "Generated by `.venv/bin/python bench/planner_refs.py --write docs/planner.md`; do not edit.",
             "", "| reference | case | compared | reference | planner | planner / reference | note |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.source} | {r.case} | {r.compared} | {r.reference:.2f} {r.unit} | {r.planner:.2f} {r.unit} "
                     f"| {r.ratio:.2f} | {r.note} |")
    return "\n".join(lines + ["", END])


def layout_table() -> str:
    """The planner's two best layouts (``flavour pp x dp x tp, checkpointing``) per case."""
    from launcher.plan.costmodel import candidates

    lines = [LAYOUTS_BEGIN, "", "| model | cluster | nodes | seq | best layout, checkpointing | GB/GPU | step s | MFU "
             "| runner-up |", "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for model, cluster, nodes, seq in LAYOUT_CASES:
        cfg = compose([f"+cluster={cluster}", f"+model={model}", f"cluster.nodes={nodes}", f"train.seq_len={seq}",
                       "train.micro_batch_size=1"])
        best = candidates(cfg)[:2]
        head = f"| {model} | {cluster} | {nodes} | {seq} |"
        if not best:
            lines.append(f"{head} nothing fits and runs | | | | |")
            continue
        k = best[0]
        second = f"{_layout(best[1])} ({best[1].time.step_s:.2f} s)" if len(best) > 1 else ""
        lines.append(f"{head} {_layout(k)} | {k.memory.total_bytes / GB:.1f} | {k.time.step_s:.2f} | {k.time.mfu:.0%} "
                     f"| {second} |")
    return "\n".join(lines + ["", LAYOUTS_END])


def _layout(k) -> str:
    s = k.cfg.strategy
    return f"{s.name} {k.layout.pp}x{k.layout.dp}x{k.layout.tp}, {s.activation_checkpointing}"


def replace_block(text: str, block: str, begin: str = BEGIN, end_mark: str = END) -> Optional[str]:
    """``text`` with its marked block replaced by ``block``; None when the markers are missing."""
    start, end = text.find(begin), text.find(end_mark)
    if start < 0 or end < start:
        return None
    return text[:start] + block + text[end + len(end_mark):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="FILE", help="replace the marked block of FILE (docs/planner.md)")
    args = ap.parse_args()
    block = render(all_rows())
    if not args.write:
        print(block)
        return
    path = Path(args.write)
    text = path.read_text()
    for begin, end, make in ((BEGIN, END, lambda: block), (LAYOUTS_BEGIN, LAYOUTS_END, layout_table)):
        new = replace_block(text, make(), begin, end)
        if new is None:
            sys.exit(f"error: {path} has no {begin} ... {end} block; add the two markers where the table goes")
        text = new
    path.write_text(text)
    print(f"wrote the reference and layout tables into {path}")


if __name__ == "__main__":
    main()
