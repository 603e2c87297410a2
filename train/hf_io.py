"""Hugging Face Llama / Qwen weights out of any checkpoint, without ever holding the whole model
in the exporting process (the way in is :mod:`train.hf_load`).

:func:`export` writes a run's newest committed checkpoint as a Hugging Face directory,
one safetensors shard (at most ``max_shard_bytes``) in memory at a time: DCP checkpoints
are read key by key (DCP assembles each tensor from every rank's shards); DeepSpeed's
through its own ``zero_to_fp32`` reader in lazy mode (ZeRO-1/2/3 partitions merged per
tensor as it is asked for).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from spec.config import ModelConfig
from spec.hf import CONFIG, INDEX, hf_config, hf_name, our_shapes
from train.hf_load import single_process
# DeepSpeed's parameter names keep the wrappers' (DCP's get_state_dict drops them)
from train.model import clean_name

GENERATION = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


Reader = Callable[[List[str]], Dict[str, torch.Tensor]]
_PREFIX = "app.model."  # the model's keys in our DCP checkpoints ({"app": AppState} -> "model")


def dcp_source(ckpt: Path) -> Tuple[Dict[str, Tuple[Tuple[int, ...], torch.dtype]], Reader]:
    """(our name -> (shape, dtype), read(names) -> full tensors) of a DCP checkpoint's model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root = str(ckpt / "dcp")
    md = dcp.FileSystemReader(root).read_metadata()
    keys = {k[len(_PREFIX):]: k for k, v in md.state_dict_metadata.items()
            if k.startswith(_PREFIX) and isinstance(v, TensorStorageMetadata)}
    shapes = {name: (tuple(md.state_dict_metadata[k].size), md.state_dict_metadata[k].properties.dtype)
              for name, k in keys.items()}

    def read(names: List[str]) -> Dict[str, torch.Tensor]:
        want = {keys[n]: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        with single_process():
            dcp.load(want, storage_reader=dcp.FileSystemReader(root), no_dist=True)
        return {n: want[keys[n]] for n in names}
    return shapes, read


def deepspeed_source(ckpt: Path) -> Tuple[Dict[str, Tuple[Tuple[int, ...], torch.dtype]], Reader]:
    """The same for DeepSpeed's files: fp32 weights merged from the ZeRO partitions lazily."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state", lazy_mode=True)
    by_name = {clean_name(k): v for k, v in lazy.items()}
    shapes = {name: (tuple(v.shape), torch.float32) for name, v in by_name.items()}

    def read(names: List[str]) -> Dict[str, torch.Tensor]:
        return {n: by_name[n].contiguous() for n in names}
    return shapes, read


def _shards(names: List[str], sizes: Dict[str, int], limit: int) -> List[List[str]]:
    shards: List[List[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def export(ckpt: Path, model: ModelConfig, out: Path, dtype: torch.dtype = torch.float32,
           max_shard_bytes: int = 5 * 10**9, tokenizer: Optional[Path] = None,
           eos_token_id: Optional[int] = None, bos_token_id: Optional[int] = None,
           source: Optional[Tuple[Dict[str, Tuple[Tuple[int, ...], torch.dtype]], Reader]] = None) -> List[Path]:
    """Write ``ckpt`` (a committed step directory) as a Hugging Face model under ``out``;
    ``source``: (shapes, reader) of the tensors instead of the checkpoint's (a LoRA run's
    merged model: train.lora_io.merged_source)."""
    from safetensors.torch import save_file

    if source is None:
        source = deepspeed_source(ckpt) if (ckpt / "deepspeed").is_dir() else dcp_source(ckpt)
    shapes, read = source
    names = [n for n in shapes if not (model.tie_embeddings and n == "output.weight")]
    missing = sorted(set(hf_to_ours(model)) - set(names))
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks {missing[0]} (and {len(missing) - 1} more) of model {model.name}")
    names = [n for n in hf_to_ours(model)]  # Hugging Face's order: embeddings, layers, norm, head
    item = torch.empty((), dtype=dtype).element_size()
    sizes = {n: item * int(torch.Size(shapes[n][0]).numel()) for n in names}
    shards = _shards(names, sizes, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    files, weight_map = [], {}
    for i, group in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {hf_name(n): t.to(dtype).contiguous() for n, t in read(group).items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        files.append(out / fname)
        del tensors
    if len(shards) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes.values())},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    dtype_name = str(dtype).replace("torch.", "")
    (out / CONFIG).write_text(json.dumps(hf_config(model, dtype_name, eos_token_id, bos_token_id), indent=2))
    (out / GENERATION).write_text(json.dumps({"_from_model_config": True, "bos_token_id": bos_token_id,
                                              "eos_token_id": eos_token_id}, indent=2))
    if tokenizer is not None:
        src = Path(tokenizer)
        for f in ([src] if src.is_file() else [src / n for n in TOKENIZER_FILES]):
            if f.is_file():
                shutil.copy2(f, out / ("tokenizer.json" if src.is_file() else f.name))
        tokenizer_config(out, eos_token_id, bos_token_id)
    return files


def tokenizer_config(out: Path, eos_id: Optional[int], bos_id: Optional[int]) -> None:
    """A tokenizer.json alone (the prepared data's) names no EOS or BOS token for
    ``transformers`` (lm-eval needs the EOS as its prefix token): write tokenizer_config.json
    naming them by the ids the data was prepared with, unless one was copied."""
    if (out / "tokenizer_config.json").exists() or not (out / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    names = {k: tok.id_to_token(i) for k, i in (("eos_token", eos_id), ("bos_token", bos_id)) if i is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in names.items() if v is not None}}, indent=2))


def hf_to_ours(model: ModelConfig) -> List[str]:
    """Our parameter names in the order Hugging Face lists its tensors."""
    return list(our_shapes(model))
