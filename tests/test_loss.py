"""The loss (train/loss.py), in process on a tiny model: the head + loss in checkpointed
chunks gives the whole logits' loss and gradients (targets of -100 included), and a
step's loss is the sum over its counted targets / their count, not a mean of
micro-batch means."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spec.config import ModelConfig, RunConfig
from spec.config_model import AUTO_CHUNK, AUTO_VOCAB, loss_chunk_tokens
from train.model import build_model

CFG = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=64)


def _model(chunk: int):
    model = build_model(dataclasses.replace(CFG, loss_chunk_tokens=chunk), "cpu")
    model.init_weights(seed=0, device=torch.device("cpu"))
    return model


def _data(seed: int, masked: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (2, 24), generator=g)
    targets[0, :masked] = -100  # positions without loss (a chat prompt)
    return tokens, targets


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_head_loss_equals_whole_logits(chunk):
    tokens, targets = _data(0, masked=9)
    whole, chunked = _model(0), _model(chunk)
    reference = F.cross_entropy(whole(tokens).flatten(0, 1), targets.flatten(), reduction="sum")
    reference.backward()
    loss = chunked(tokens, targets)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    # the loss without targets (whole logits in the model) is the same sum
    torch.testing.assert_close(whole(tokens, targets).detach(), reference.detach(), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(chunked.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunk_default_by_vocabulary():
    def chunk(vocab, configured):
        return loss_chunk_tokens(ModelConfig(vocab_size=vocab, loss_chunk_tokens=configured))

    assert chunk(AUTO_VOCAB, None) == AUTO_CHUNK and chunk(AUTO_VOCAB - 1, None) == 0
    assert chunk(256, 512) == 512 and chunk(152064, 0) == 0



def test_chunk_default_on_a_gpu_by_the_share_of_memory_the_logits_take():
    """Whole logits on a GPU while one micro-batch's (10 bytes a token and vocabulary entry)
    take at most a quarter of its memory: a 1B Llama's 8k tokens at 128k (10.5 GB of 80) run
    whole, 16k tokens (21 GB) and Qwen's 152k at 64k tokens (100 GB) in chunks; off a GPU,
    or where its memory is unknown, chunks as before; a configured value always wins."""
    llama, qwen = ModelConfig(vocab_size=128256), ModelConfig(vocab_size=152064)
    assert loss_chunk_tokens(llama, 8192, 80) == 0
    assert loss_chunk_tokens(llama, 16384, 80) == AUTO_CHUNK
    assert loss_chunk_tokens(qwen, 65536, 80) == AUTO_CHUNK
    assert loss_chunk_tokens(llama, 8192, None) == AUTO_CHUNK
    assert loss_chunk_tokens(dataclasses.replace(llama, loss_chunk_tokens=512), 8192, 80) == 512
    assert loss_chunk_tokens(ModelConfig(vocab_size=32000), 10**6, 80) == 0


@pytest.mark.parametrize("micro, gpu_mem_gb", [(4, 80), (8, 80), (4, 40), (4, None)])
def test_the_trainer_chunks_as_the_planner_counts(micro, gpu_mem_gb):
    """train.model.head_loss_chunk (what the ranks run) and launcher.plan.head.loss_chunk
    (what the memory plan counts) decide alike for a GPU cluster's run."""
    from helpers import compose_run
    from launcher.plan.head import loss_chunk
    from spec.layout import build_layout
    from train.model import head_loss_chunk

    cfg = compose_run(["+cluster=a100x8", "+model=llama3_1b", "train.seq_len=2048",
                       f"train.micro_batch_size={micro}", f"cluster.gpu_mem_gb={gpu_mem_gb or 'null'}"])
    planned = loss_chunk(cfg, build_layout(cfg))
    assert planned == (0 if (micro, gpu_mem_gb) == (4, 80) else AUTO_CHUNK)
    if gpu_mem_gb:  # the device's own memory is read only where the cluster does not say
        assert head_loss_chunk(cfg, torch.device("cuda")) == planned
    assert head_loss_chunk(cfg, torch.device("cpu")) == AUTO_CHUNK

def test_step_loss_is_sum_over_counted_targets_not_mean_of_means():
    """Two micro-batches with 39 and 48 counted targets: the step's loss and gradients are
    those of all 87 tokens' mean, which differs from the mean of the two means."""
    from train.strategies.base import TorchEngine

    cfg = RunConfig(model=CFG)
    cfg.optim.grad_clip = 0.0
    model = _model(8)
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, torch.device("cpu"))
    batches = [_data(1, masked=9), _data(2, masked=0)]
    loss, _ = engine.train_step(batches, lr=0.0)
    grads = [p.grad.clone() for p in model.parameters()]

    reference = _model(0)
    logits = torch.cat([reference(x) for x, _ in batches]).flatten(0, 1)
    targets = torch.cat([y for _, y in batches]).flatten()
    mean = F.cross_entropy(logits, targets)  # over the 87 counted targets
    mean.backward()
    torch.testing.assert_close(loss, mean.detach(), rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        means = sum(F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) for x, y in batches) / 2
    assert abs(float(means) - float(mean.detach())) > 1e-3  # the case tells the two apart

    # the step's share given (the global batch's count / dp): each sum is divided by it
    share_loss, _ = engine.train_step(batches, lr=0.0, share=87 * 2)
    torch.testing.assert_close(share_loss, mean.detach() / 2, rtol=1e-5, atol=1e-6)
    assert torch.allclose(engine.eval_loss(batches), mean.detach(), rtol=1e-5, atol=1e-6)


def test_planner_counts_one_chunk_of_logits():
    """At Qwen's 152k vocabulary and 8k tokens the plan stops counting whole logits: with
    chunks it counts one chunk's, (e + 8) x vocab x chunk; under tensor parallel (the
    vocab-parallel loss) the logits stay counted per token."""
    from launcher.plan.memory import activation_bytes, compute_bytes
    from spec.layout import build_layout

    def plan(chunk, tp=1):
        cfg = RunConfig(model=ModelConfig(dim=3584, n_layers=4, n_heads=28, n_kv_heads=4, vocab_size=152064,
                                          max_seq_len=8192, loss_chunk_tokens=chunk))
        cfg.train.seq_len, cfg.train.micro_batch_size = 8192, 1
        cfg.cluster.gpus_per_node, cfg.strategy.tensor_parallel = tp, tp
        layout = build_layout(cfg)
        return activation_bytes(cfg, layout, "full"), compute_bytes(cfg)

    (whole, e), (chunked, _), (auto, _) = plan(0), plan(1024), plan(None)
    vocab, tokens = 152064, 8192
    # whole: (e + 4) + 4 bytes per token per vocabulary entry; chunked: e + 8 for 1024 tokens
    assert whole - chunked == pytest.approx((e + 8) * vocab * tokens - (e + 8) * vocab * 1024, rel=1e-9)
    assert auto < whole and whole - chunked > 0.75 * (e + 8) * vocab * tokens
    tp_whole, tp_chunk = plan(0, tp=2)[0], plan(1024, tp=2)[0]
    assert tp_whole == tp_chunk


def test_negative_chunk_is_refused_naming_the_field():
    from spec.config import ConfigError
    from spec.validate import validate

    cfg = RunConfig()
    cfg.model.loss_chunk_tokens = -1
    with pytest.raises(ConfigError, match=r"model.loss_chunk_tokens=-1 must be >= 0; set e.g. model.loss_chunk_tokens=0"):
        validate(cfg)


def test_chat_data_over_two_data_parallel_ranks_equals_one(tmp_path):
    """Chat data (targets -100 at prompts and padding), in process: two data-parallel
    ranks, each dividing its sums by the step's count / 2, average (as DDP, FSDP and ZeRO
    average gradients) to what one rank holding the whole global batch gets, though the
    ranks count different numbers of targets; chunked head (16 tokens) included."""
    from test_chat_data import run_prepare
    from train.data.chat_loader import ChatLoader
    from train.loss import counted
    from train.strategies.base import TorchEngine

    prepared = run_prepare(tmp_path, "--max-length", "65")[0]
    model_cfg = dataclasses.replace(CFG, vocab_size=384, loss_chunk_tokens=16)
    cfg = RunConfig(model=model_cfg)
    cfg.optim.grad_clip = 0.0

    def step(rank: int, dp: int, accum: int):
        loader = ChatLoader(prepared, "train", 64, 3, accum, rank, dp, seed=5)
        batches = loader.next_step()
        model = build_model(model_cfg, "cpu")
        model.init_weights(seed=0, device=torch.device("cpu"))
        engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, torch.device("cpu"))
        loss, _ = engine.train_step(batches, 0.0, loader.step_targets / loader.dp_size)
        return loss, [p.grad for p in model.parameters()], loader.step_targets, counted(batches)

    (l0, g0, t0, c0), (l1, g1, t1, c1), (whole, g, t, c) = step(0, 2, 2), step(1, 2, 2), step(0, 1, 4)
    assert t0 == t1 == t == c0 + c1 == c and c0 != c1  # the ranks' counts differ
    torch.testing.assert_close((l0 + l1) / 2, whole, rtol=1e-5, atol=1e-6)
    for a, b, ref in zip(g0, g1, g):
        torch.testing.assert_close((a + b) / 2, ref, rtol=1e-4, atol=1e-6)


def test_every_chunk_but_the_last_is_recomputed_in_the_backward():
    """The head runs once per chunk in the forward, and again in the backward for every
    chunk but the last (its logits are kept: its backward comes first); the gradient is
    the whole logits' either way."""
    from train.loss import chunked_head_loss, loss_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    h = torch.randn(2, 12, 8, requires_grad=True)
    targets = torch.randint(0, 32, (2, 12))
    for chunk, expected in ((24, [24]), (10, [10, 10, 4, 10, 10])):
        calls.clear()
        h.grad = None
        chunked_head_loss(head, h, targets, chunk).backward()
        assert calls == expected, (chunk, calls)
        got = h.grad.clone()
        h.grad = None
        loss_sum(head(h), targets).backward()
        torch.testing.assert_close(got, h.grad)
