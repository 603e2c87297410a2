"""Packing chat conversations (``data.packing=true``).

- a packed row gives each conversation the loss and the gradients it has alone, unpacked
  (fp32 tolerance), and no attention crosses conversations (another conversation's tokens
  changed: this one's logits bitwise unchanged), with positions restarting per
  conversation; on CPU the model runs SDPA with a dense mask (flex attention has no CPU
  backward), so the flex attention path (CUDA's) is checked forward here: its block mask
  is ``create_block_mask``'s, its outputs the dense path's;
- the loader packs whole conversations deterministically, each once an epoch, resumes
  mid-epoch exactly (at another data-parallel size too), and the schedule counts packed
  sequences;
- what cannot run fused is refused at launch in one line; a packed run trains under FSDP
  x TP on 2 ranks like one process.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import compose_run
from spec.config import ConfigError
from spec.layout import build_layout
from spec.packing import pack
from spec.schedule import schedule
from spec.support import check_supported
from test_chat_data import run_prepare, split_arrays
from train.data.chat_loader import IGNORE, ChatLoader, PackedChatLoader

SEQ = 128  # the fixtures' conversations (41-65 tokens, --max-length 65): 2 or 3 a sequence


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return run_prepare(tmp_path_factory.mktemp("chat"), "--max-length", "65")[0]


def packed(prepared, rank=0, dp=1, micro=2, accum=1) -> PackedChatLoader:
    return PackedChatLoader(prepared, "train", SEQ, micro, accum, rank, dp, seed=5)


def tiny_model():
    from spec.config_model import ModelConfig
    from train.model import build_model, materialise

    model = build_model(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, max_seq_len=SEQ))
    materialise([model], 0, torch.device("cpu"))
    return model


def documents(positions: torch.Tensor) -> list:
    """(start, length) of each conversation of a packed row (the padding after them left out)."""
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    return [(a, b - a) for a, b in zip(starts[:-1], starts[1:])]


def test_pack_is_best_fit_decreasing_of_whole_items():
    order, starts = pack([5, 9, 3, 7, 2, 4], 10)
    assert [order[a:b] for a, b in zip(starts[:-1], starts[1:])] == [[1], [3, 2], [0, 5], [4]]
    assert pack([4, 4, 4], 10)[1] == [0, 2, 3]  # ties: the earlier first
    with pytest.raises(ValueError, match="does not fit"):
        pack([11], 10)


def test_packed_rows_hold_whole_conversations_and_restart_positions(prepared):
    tokens, mask, offsets = split_arrays(prepared, "train")
    lo = packed(prepared, micro=4)
    ids = lo.stream(0, 4)
    (inputs, targets, positions), = lo.next_step()
    for row, p in enumerate(ids):
        convs = lo.order[lo.starts[p]:lo.starts[p + 1]]
        docs, used = documents(positions[row]), int(lo.sizes[convs].sum())
        assert len(docs) == len(convs) + (used < SEQ) and sum(n for _, n in docs) == SEQ  # then any padding
        for (at, n), i in zip(docs, convs):
            conv = tokens[offsets[i]:offsets[i + 1]].astype(np.int64)
            carry = mask[offsets[i] + 1:offsets[i + 1]] == 1
            assert n == len(conv) - 1 and positions[row, at:at + n].tolist() == list(range(n))
            assert inputs[row, at:at + n].tolist() == conv[:-1].tolist()  # the last token is no input
            assert targets[row, at:at + n].tolist() == np.where(carry, conv[1:], IGNORE).tolist()
        assert (targets[row, used:] == IGNORE).all() and positions[row, used:].tolist() == list(range(SEQ - used))
    assert lo.step_targets == int((targets != IGNORE).sum()) > 0


def _alone(prepared, conv: int):
    """Conversation ``conv`` unpacked, as data.packing=false feeds it."""
    unpacked = ChatLoader(prepared, "train", SEQ, 1, 1, 0, 1, seed=5)
    return unpacked._rows(np.array([conv]))


def _loss_and_grads(model, *args):
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_each_conversation_has_its_own_loss_and_gradients(prepared):
    """Packed, each conversation's loss (its targets only) and gradients equal those of the
    conversation alone, unpacked (padded, plain causal SDPA), in fp32."""
    model = tiny_model()
    lo = packed(prepared)
    ids = lo.stream(0, 2)
    (inputs, targets, positions), = lo.next_step()
    total, seen = model(inputs, targets, positions).detach(), 0
    for row, p in enumerate(ids):
        for (at, n), conv in zip(documents(positions[row]), lo.order[lo.starts[p]:lo.starts[p + 1]]):
            own = torch.full_like(targets[row:row + 1], IGNORE)
            own[0, at:at + n] = targets[row, at:at + n]
            loss, grads = _loss_and_grads(model, inputs[row:row + 1], own, positions[row:row + 1])
            alone_loss, alone_grads = _loss_and_grads(model, *_alone(prepared, int(conv)))
            torch.testing.assert_close(loss, alone_loss, rtol=1e-5, atol=1e-5)
            for a, b in zip(grads, alone_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
            seen += float(loss)
    assert abs(seen - float(total)) < 1e-3 * float(total)


def _flex_context(monkeypatch):
    """The model with CUDA's attention (a flex block mask) on CPU: forward only."""
    import train.model
    from train.packed_attention import block_mask, rope_at

    monkeypatch.setattr(train.model, "document_context", lambda table, pos: (rope_at(table, pos), block_mask(pos)))


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_no_attention_across_conversations(prepared, monkeypatch, attention):
    """Another conversation's tokens changed: this one's logits bitwise unchanged; the flex
    path's logits are the dense path's."""
    model = tiny_model()
    (inputs, _, positions), = packed(prepared).next_step()
    with torch.no_grad():
        dense = model(inputs, positions=positions)
        if attention == "flex":
            _flex_context(monkeypatch)
        logits = model(inputs, positions=positions)
        torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5)
        docs = documents(positions[0])
        assert len(docs) >= 2
        (a, n), (b, m) = docs[0], docs[1]
        other = inputs.clone()
        other[0, a:a + n] = (other[0, a:a + n] + 1 + torch.arange(n)) % 341
        changed = model(other, positions=positions)
        assert torch.equal(changed[0, b:b + m], logits[0, b:b + m])  # the second conversation: bitwise
        assert not torch.equal(changed[0, a:a + n], logits[0, a:a + n])
        assert torch.equal(changed[1], logits[1])  # another row
        # and a conversation sees its own positions wherever it sits: moved to the front, same logits
        alone = model(inputs[:1, b:b + m], positions=positions[:1, b:b + m])
        torch.testing.assert_close(alone[0], logits[0, b:b + m], rtol=1e-5, atol=1e-5)


def test_block_mask_is_create_block_masks():
    """CUDA's block mask, built from the boundaries tile by tile, is the one torch's
    ``create_block_mask`` evaluates pair by pair: the same empty, partial and full tiles."""
    from torch.nn.attention.flex_attention import create_block_mask
    from train.packed_attention import block_mask, document_ids

    def row(lengths, seq):
        out = [i for n in lengths for i in range(n)]
        return out + list(range(seq - len(out)))

    for seq, a, b in ((300, [5, 130, 40, 100], [300]), (256, [128, 128], [1, 127, 128]),
                      (512, [256, 100, 28, 1, 1, 126], [129, 255]), (129, [1, 127], [64])):
        positions = torch.tensor([row(a, seq), row(b, seq)])
        docs = document_ids(positions)
        ours = block_mask(positions)
        theirs = create_block_mask(lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv), 2, None, seq, seq,
                                   device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), (seq, name)
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            n = getattr(ours, count)
            for bi, qi in np.ndindex(n.shape[0], n.shape[2]):
                k = int(n[bi, 0, qi])
                assert torch.equal(getattr(ours, indices)[bi, 0, qi, :k], getattr(theirs, indices)[bi, 0, qi, :k])


def _steps(loaders, steps):
    out = []
    for _ in range(steps):
        out.append([lo.next_step() for lo in loaders])
    return out


def test_loader_is_deterministic_and_resumes_at_any_dp_size(prepared, tmp_path):
    """21 packed sequences an epoch, global batch 4: two loaders agree, each epoch holds
    every conversation once, and a state saved mid-epoch at dp 2 resumes at dp 1 (and 4)
    on the very samples (ids and tensors) the uninterrupted run takes."""
    first, again = packed(prepared, dp=1, micro=4), packed(prepared, dp=1, micro=4)
    assert first.num_windows == 21 and sorted(first.order.tolist()) == list(range(44))
    whole = _steps([first], 10)  # 40 samples: nearly two epochs
    assert all(torch.equal(x, y) for s, t in zip(whole, _steps([again], 10)) for x, y in zip(s[0][0], t[0][0]))
    assert sorted(first.stream(0, 21).tolist()) == list(range(21)) != first.stream(0, 21).tolist()

    dp2 = [packed(prepared, rank=r, dp=2) for r in range(2)]
    head = _steps(dp2, 3)  # step 3 ends mid epoch 0
    for a, b in zip(head, whole[:3]):
        assert torch.equal(torch.cat([a[0][0][0], a[1][0][0]]), b[0][0][0])  # rank slices = the one-rank batch
    for dp, micro in ((1, 4), (4, 1)):
        resumed = [packed(prepared, rank=r, dp=dp, micro=micro) for r in range(dp)]
        for r, lo in enumerate(resumed):
            lo.load_state_dict(json.loads(json.dumps(dp2[0].state_dict())))
            lo.trace = tmp_path / f"dp{dp}_rank{r}.txt"
        for want in whole[3:]:
            got = [lo.next_step() for lo in resumed]
            for column in range(3):
                assert torch.equal(torch.cat([g[0][column] for g in got]), want[0][0][column])
        traced = [int(i) for lo in resumed for line in lo.trace.read_text().splitlines() for i in line.split()[1:]]
        assert sorted(traced) == sorted(first.stream(12, 28).tolist())  # nothing skipped, nothing repeated


def test_schedule_counts_packed_sequences(prepared):
    cfg = compose_run([f"data.path={prepared}", "data.source=chat", "data.packing=true", f"train.seq_len={SEQ}",
                       "model.vocab_size=384", "train.micro_batch_size=4", "train.epochs=2"])
    s = schedule(cfg, build_layout(cfg))
    assert s.global_batch == 8  # micro 4 x the local cluster's 2 ranks
    assert s.samples_per_epoch == packed(prepared).num_windows == 21 and s.total_steps == 6  # ceil(2 x 21 / 8)
    cfg.data.packing = False
    assert schedule(cfg, build_layout(cfg)).samples_per_epoch == 44


@pytest.mark.parametrize("overrides, message", [
    (["data.source=markov"], "data.packing=true packs chat conversations, but data.source=markov; use data.source=chat"),
    (["data.source=chat", "+strategy=pp", "cluster.gpus_per_node=2"],
     "data.packing=true with strategy.pipeline_parallel=2: the pipeline's stages pass activations only"),
    (["data.source=chat", "+cluster=h100x8", "model.dim=64", "model.n_heads=8"],
     "flex attention, whose CUDA kernel takes heads of at least 16 channels; the model's are 8"),
], ids=["markov", "pp", "gpu-narrow-heads"])
def test_what_cannot_run_fused_is_refused(overrides, message):
    cfg = compose_run(["data.packing=true", *overrides])
    with pytest.raises(ConfigError) as err:
        check_supported(cfg, build_layout(cfg))
    assert message in str(err.value) and "data.packing=false" in str(err.value) and "\n" not in str(err.value)
    cfg.data.packing = False
    check_supported(cfg, build_layout(cfg))


@pytest.mark.slow
def test_packed_run_under_fsdp_tp_trains_like_one_process(prepared, tmp_path):
    """Through the launcher: FSDP x TP on 2 ranks (the mask reaches the TP-sharded attention
    by keyword) and one DDP process take the same packed batches to the same losses; the
    refusal is one line with nothing run."""
    from conftest import run_dir_of
    from spec.rundir import read_metrics
    from warm import launcher

    common = [f"data.path={prepared}", "data.source=chat", "data.packing=true", f"train.seq_len={SEQ}",
              "model.vocab_size=384", "train.steps=3", "strategy.mixed_precision=fp32", "train.micro_batch_size=4"]
    losses = []
    for extra in (["cluster.gpus_per_node=1"], ["+strategy=fsdp_tp", "strategy.tensor_parallel=2", "cluster.gpus_per_node=2"]):
        proc = launcher(common + extra, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses.append([row["loss"] for row in read_metrics(run_dir_of(proc.stdout))])
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    (tmp_path / "refused").mkdir()
    proc = launcher(common + ["+strategy=pp", "cluster.gpus_per_node=2"], cwd=tmp_path / "refused", timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "strategy.pipeline_parallel=2" in err[-1], proc.stdout + proc.stderr
    assert not (tmp_path / "refused" / "runs").exists()


def test_a_position_saved_unpacked_or_at_another_length_is_refused(prepared):
    """A sample index counts conversations unpacked and packed sequences of one train.seq_len
    packed: a checkpoint's data position resumed with data.packing flipped, or packed at
    another length, would take other samples, so the loader refuses it in one line."""

    unpacked = ChatLoader(prepared, "train", SEQ, 2, 1, 0, 1, 5)
    saved = unpacked.state_dict()
    assert saved["samples_are"] == "conversations"
    with pytest.raises(ValueError, match=r"counts conversations, this run's data packed sequences of \d+ tokens: "
                                         r"resume with the data.packing and train.seq_len it was saved with$"):
        packed(prepared).load_state_dict(saved)
    longer = PackedChatLoader(prepared, "train", SEQ + 16, 2, 1, 0, 1, seed=5)
    with pytest.raises(ValueError, match=f"packed sequences of {SEQ + 16} tokens, this run's data packed "
                                         f"sequences of {SEQ} tokens"):
        packed(prepared).load_state_dict(longer.state_dict())
    packed(prepared).load_state_dict(packed(prepared).state_dict())  # the same kind resumes
    unpacked.load_state_dict({"step": 3, "samples": 12})  # a state saved before the kind was kept
