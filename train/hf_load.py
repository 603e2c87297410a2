"""Hugging Face Llama weights into the model parts a builder made (plain tensors, FSDP/TP
DTensors, pipeline stages), through DCP's Hugging Face storage reader: each rank reads
only the slices it holds (``safe_open(...).get_slice``), in the checkpoint's dtype,
copied into ours. :func:`train.model.materialise` calls it; the way out is
:mod:`train.hf_io`. Imports nothing of ``train``, so the model can use it.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterable

from torch import nn

from spec.hf import hf_name
from spec.peft import is_adapter


def _source_name(ours: str, tied: bool) -> str:
    """The Hugging Face tensor that fills our parameter ``ours`` (a tied head reads the embedding)."""
    if tied and ours == "output.weight":
        return hf_name("tok_embeddings.weight")
    return hf_name(ours)


@contextlib.contextmanager
def single_process():
    """DCP's ``no_dist`` load, without its warning that no process group is in use (intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_hf(parts: Iterable[nn.Module], path: str, tied: bool) -> int:
    """Copy the checkpoint at ``path`` into every parameter of ``parts``; returns the number
    of tensors read. No collective: each rank reads its own slices (``no_dist``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    count = 0
    for part in parts:
        ours = {k: v for k, v in get_model_state_dict(part).items() if not is_adapter(k)}  # LoRA's: not in it
        if tied and "tok_embeddings.weight" in ours:
            ours.pop("output.weight", None)  # the same Parameter: filled through the embedding
        theirs = {_source_name(name, tied): tensor for name, tensor in ours.items()}
        with single_process():
            dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(path), no_dist=True)
        loaded = {name: theirs[_source_name(name, tied)] for name in ours}
        set_model_state_dict(part, loaded, options=StateDictOptions(strict=False))
        count += len(loaded)
    return count
