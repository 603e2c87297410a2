"""A checkpoint's RNG state asks CUDA only where the rank uses CUDA: a CPU profile on a GPU
node (torch.cuda.is_available() true, CUDA never initialised) must not open a context on
GPU 0 for every rank by asking for CUDA's generator."""
from __future__ import annotations

from unittest import mock

import torch

from train.checkpoint import state


def test_a_process_that_never_used_cuda_does_not_ask_it():
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "is_initialized", return_value=False), \
            mock.patch.object(torch.cuda, "get_rng_state", side_effect=AssertionError("CUDA asked")) as get, \
            mock.patch.object(torch.cuda, "set_rng_state", side_effect=AssertionError("CUDA asked")) as put:
        saved = state.rng_state()
        state.set_rng_state({**saved, "cuda": torch.zeros(8, dtype=torch.uint8)})
    assert "cuda" not in saved and not get.called and not put.called


def test_a_process_on_cuda_saves_and_restores_its_generator():
    cuda_state = torch.arange(8, dtype=torch.uint8)
    with mock.patch.object(torch.cuda, "is_initialized", return_value=True), \
            mock.patch.object(torch.cuda, "get_rng_state", return_value=cuda_state), \
            mock.patch.object(torch.cuda, "set_rng_state") as put:
        saved = state.rng_state()
        state.set_rng_state(saved)
    assert saved["cuda"] is cuda_state and put.call_args.args[0] is cuda_state
