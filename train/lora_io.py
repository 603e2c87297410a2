"""A LoRA run's checkpoint out, as PEFT writes it or merged into its base.

- :func:`export_adapter`: ``adapter_config.json`` + ``adapter_model.safetensors`` with
  PEFT's key names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
  the directory ``PeftModel.from_pretrained(model, dir)`` loads onto the base model;
- :func:`merged_source`: the base's tensors with each adapter's update added
  (``W + alpha / rank x B A``, as PEFT's ``merge_and_unload``), for
  :func:`train.hf_io.export`, which writes it as a full Hugging Face model.

The checkpoint holds the adapters only (and their optimizer state): the base is read
from ``model.hf_path``, or drawn again from the run's seed (its initial weights).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from spec.config import RunConfig
from spec.hf import hf_name, our_shapes, tensor_index
from spec.peft import is_adapter, target_names
from train.hf_io import Reader, dcp_source, deepspeed_source

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
Shapes = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def peft_key(ours: str) -> str:
    """``layers.0.attention.wq.lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    module, _, matrix = ours.rpartition(".")
    return f"base_model.model.{hf_name(module + '.weight')[:-len('.weight')]}.{matrix}.weight"


def adapter_config(cfg: RunConfig) -> dict:
    """PEFT's LoraConfig of the run (the fields ``LoraConfig.from_pretrained`` reads)."""
    p = cfg.peft
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.model.hf_path,
            "r": p.rank, "lora_alpha": p.alpha, "lora_dropout": p.dropout, "target_modules": target_names(cfg),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}


def checkpoint_source(ckpt: Path) -> Tuple[Shapes, Reader]:
    """The adapters in a committed step directory (DCP's or DeepSpeed's files)."""
    shapes, read = deepspeed_source(ckpt) if (ckpt / "deepspeed").is_dir() else dcp_source(ckpt)
    return {n: s for n, s in shapes.items() if is_adapter(n)}, read


def export_adapter(ckpt: Path, cfg: RunConfig, out: Path) -> List[Path]:
    """Write ``ckpt``'s adapters as a PEFT adapter directory under ``out`` (fp32)."""
    from safetensors.torch import save_file

    shapes, read = checkpoint_source(ckpt)
    if not shapes:
        raise ValueError(f"checkpoint {ckpt} holds no LoRA adapter (was it saved by a run with +peft=lora?)")
    tensors = {peft_key(n): t.float().contiguous() for n, t in read(sorted(shapes)).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg), indent=2))
    return [out / ADAPTER_WEIGHTS]


def base_source(cfg: RunConfig) -> Tuple[Shapes, Reader]:
    """The frozen base's tensors by our names: ``model.hf_path``'s, or the initial weights."""
    shapes = {n: (s, torch.float32) for n, s in our_shapes(cfg.model).items()}
    if cfg.model.hf_path:
        from safetensors import safe_open

        files = tensor_index(cfg.model.hf_path)

        def read(names: List[str]) -> Dict[str, torch.Tensor]:
            out = {}
            for n in names:
                with safe_open(str(Path(cfg.model.hf_path) / files[hf_name(n)][2]), framework="pt") as f:
                    out[n] = f.get_tensor(hf_name(n)).float()
            return out
        return shapes, read
    from train.initial import initial_tensor

    def drawn(names: List[str]) -> Dict[str, torch.Tensor]:
        return {n: initial_tensor(cfg.model, n, shapes[n][0], cfg.train.seed) for n in names}
    return shapes, drawn


def merged_source(ckpt: Path, cfg: RunConfig) -> Tuple[Shapes, Reader]:
    """The base with ``ckpt``'s adapters merged: ``W + alpha / rank x B @ A`` per target."""
    base_shapes, base_read = base_source(cfg)
    adapters, adapter_read = checkpoint_source(ckpt)
    scaling = cfg.peft.alpha / cfg.peft.rank

    def read(names: List[str]) -> Dict[str, torch.Tensor]:
        out = base_read(names)
        for n in names:
            module = n[:-len(".weight")]
            if f"{module}.lora_A" in adapters:
                ab = adapter_read([f"{module}.lora_A", f"{module}.lora_B"])
                out[n] = out[n] + (ab[f"{module}.lora_B"].float() @ ab[f"{module}.lora_A"].float()) * scaling
        return out
    return base_shapes, read
