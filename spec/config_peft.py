"""The ``peft.*`` section of the run configuration: parameter-efficient fine-tuning of the
built-in trainer (``+peft=lora``). Pure; :mod:`spec.config` re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class PeftConfig:
    # null: every parameter trains (full fine-tuning); "lora": low-rank adapters on the
    # target modules, the base weights frozen (conf/peft/lora.yaml).
    method: Optional[str] = None
    # LoRA rank r and scaling alpha (the update is alpha / r x B A), as PEFT's LoraConfig.
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # Module names as PEFT names them (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    # down_proj), or "all-linear": every linear layer of the blocks (not the output head).
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # After the last step, gather every frozen base tensor and compare it bit for bit with
    # the base as loaded (model.hf_path's, or the initial weights; run.json "lora_base":
    # tensors compared, those changed). Reads the whole base once more and gathers it tensor
    # by tensor: off by default.
    verify_base: bool = False
