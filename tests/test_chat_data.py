"""Chat data: ``train.data.prepare --chat`` and ``data.source=chat``.

- the rendering equals transformers' ``apply_chat_template(tokenize=False)``; the tokens
  and the assistant mask equal its ``return_assistant_tokens_mask=True`` (a template with
  ``{% generation %}``); without markers the prefix renders find the same spans as the
  same template with markers;
- prepare: counts of truncated / dropped conversations and loss tokens match the files;
  ``--loss-on all``; the split; bad inputs refused in one line;
- the loader: targets are -100 exactly at masked and padding positions, ``step_targets``
  counts the whole global batch, a resume mid-epoch continues with the same samples;
- the mask test: labels changed at masked positions leave the loss and every gradient
  bitwise unchanged, at an unmasked position they do not.

Fixtures: tests/fixtures/chat (make.py wrote them).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from spec.config import ConfigError
from train.data import prepare as prep
from train.data.chat import ChatTemplate, special_tokens, template_source, token_mask
from train.data.chat_loader import IGNORE, ChatLoader, masked_targets

FIX = REPO / "tests" / "fixtures" / "chat"
CONVS = [json.loads(line)["messages"] for line in (FIX / "conversations.jsonl").read_text().splitlines()]
# The llama fixture's template with generation markers around each assistant turn's text and end.
LLAMA_MARKED = (
    "{{- bos_token }}\n{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}\n"
    "{%- endfor %}\n")


def ours(name: str, loss_on: str = "assistant", source: str = None) -> tuple:
    tok, file, config = prep.load_tokenizer(FIX / name)
    return tok, ChatTemplate(source or template_source(file, config), special_tokens(config), loss_on)


def hf(name: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(FIX / name))


def encode(tok, template, messages) -> tuple:
    text, spans = template.render(messages)
    enc = tok.encode(text, add_special_tokens=False)
    return enc.ids, token_mask(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), spans).tolist()


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_rendering_equals_transformers(name):
    _, template = ours(name)
    theirs = hf(name)
    for messages in CONVS[:6]:
        for prompt in (False, True):
            assert template.text(messages, prompt) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)


def test_assistant_mask_equals_transformers():
    tok, template = ours("qwen")
    theirs = hf("qwen")
    assert template.method == "generation markers"
    for messages in CONVS[:8]:
        out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encode(tok, template, messages)
        assert ids == out["input_ids"] and mask == out["assistant_masks"] and 0 < sum(mask) < len(mask)


def test_prefix_spans_equal_the_marked_template():
    tok, plain = ours("llama")
    _, marked = ours("llama", source=LLAMA_MARKED)
    assert plain.method == "prefix renders"
    theirs = hf("llama")
    for messages in CONVS[:8]:
        out = theirs.apply_chat_template(messages, chat_template=LLAMA_MARKED, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert encode(tok, plain, messages) == encode(tok, marked, messages) == (out["input_ids"],
                                                                                  out["assistant_masks"])


def run_prepare(tmp_path, *extra, name="qwen", inputs=None) -> tuple:
    out = tmp_path / "out"
    prep.main([str(inputs or FIX / "conversations.jsonl"), "--chat", "--tokenizer", str(FIX / name), "--out",
               str(out), "--no-progress", "--val-fraction", "0.1", *extra])
    return out, json.loads((out / "manifest.json").read_text())


def split_arrays(out: Path, split: str) -> tuple:
    dtype = json.loads((out / "manifest.json").read_text())["dtype"]
    return (np.fromfile(out / f"{split}.bin", dtype=dtype), np.fromfile(out / f"{split}_mask.bin", dtype=np.uint8),
            np.fromfile(out / f"{split}_offsets.bin", dtype=np.int64))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_prepare_counts_truncated_dropped_and_loss_tokens(tmp_path, overlong):
    tok, template = ours("qwen")
    lengths = [len(encode(tok, template, m)[0]) for m in CONVS]
    limit = int(np.median(lengths))
    over = sum(n > limit for n in lengths)
    out, info = run_prepare(tmp_path, "--max-length", str(limit), "--overlong", overlong)
    assert info["format"] == "chat" and info["spans"] == "generation markers" and over > 0
    assert info[overlong + ("d" if overlong == "truncate" else "ped")] == over
    kept = len(CONVS) - (over if overlong == "drop" else 0)
    splits = info["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == kept and splits["val"]["documents"] >= 1
    for split in ("train", "val"):
        tokens, mask, offsets = split_arrays(out, split)
        assert len(offsets) == splits[split]["documents"] + 1 and offsets[-1] == len(tokens) == len(mask)
        assert np.diff(offsets).max() <= limit and splits[split]["tokens"] == len(tokens)
        assert splits[split]["loss_tokens"] == sum(int(mask[a + 1:b].sum()) for a, b in zip(offsets, offsets[1:]))
    assert info["longest"] == (limit if overlong == "truncate" else max(n for n in lengths if n <= limit))


def test_prepare_loss_on_all_and_pad(tmp_path):
    out, info = run_prepare(tmp_path, "--loss-on", "all", name="llama")
    tokens, mask, offsets = split_arrays(out, "train")
    assert info["spans"] == "all tokens" and mask.all() and len(tokens) == offsets[-1]
    assert info["pad_id"] == info["eos_id"]  # llama fixture: no pad token


@pytest.mark.parametrize("record, message", [
    ({"text": "hi"}, "has no 'messages' list"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
])
def test_bad_records_refused(tmp_path, record, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_prepare(tmp_path, inputs=bad)


def test_bad_tokenizer_and_options_refused(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text((FIX / "qwen" / "tokenizer.json").read_text())
    with pytest.raises(SystemExit, match="has no chat template"):
        run_prepare(tmp_path, name=tmp_path / "tok")
    with pytest.raises(SystemExit):
        run_prepare(tmp_path, "--loss-on", "user")
    assert "--loss-on=user is unknown; use assistant or all" in capsys.readouterr().err


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return run_prepare(tmp_path_factory.mktemp("chat"), "--max-length", "65")[0]


def test_source_and_manifest_must_agree(prepared, tmp_path):
    from helpers import compose_run
    from spec.data import check_data

    cfg = compose_run([f"data.path={prepared}", "data.source=tokens", "model.vocab_size=384"])
    with pytest.raises(ConfigError, match="holds chat data; use data.source=chat"):
        check_data(cfg)
    cfg.data.source = "chat"
    check_data(cfg)
    cfg.train.seq_len = 32
    with pytest.raises(ConfigError, match="longest conversation has 65 tokens"):
        check_data(cfg)
    text, _ = run_prepare(tmp_path, inputs=FIX / "conversations.jsonl")  # a chat dir: now a tokens one
    (text / "manifest.json").write_text((text / "manifest.json").read_text().replace('"chat"', '"tokens"'))
    cfg.data.path, cfg.train.seq_len = str(text), 64
    with pytest.raises(ConfigError, match="holds tokens data; use data.source=tokens"):
        check_data(cfg)


def loader(prepared, rank=0, dp=2, accum=2) -> ChatLoader:
    return ChatLoader(prepared, "train", 64, 3, accum, rank, dp, seed=5)


def test_loader_targets_and_step_targets(prepared):
    tokens, mask, offsets = split_arrays(prepared, "train")
    pad = json.loads((prepared / "manifest.json").read_text())["pad_id"]
    ranks = [loader(prepared, r) for r in range(2)]
    for _ in range(3):
        counted = 0
        for lo in ranks:
            start = lo.state.samples + lo.dp_rank * 6
            ids = lo.stream(start, 6)
            for k, (inputs, targets) in enumerate(lo.next_step()):
                assert inputs.shape == targets.shape == (3, 64)
                for row in range(3):
                    i = ids[k * 3 + row]
                    conv = tokens[offsets[i]:offsets[i + 1]].astype(np.int64)
                    want = np.full(65, IGNORE)
                    carry = mask[offsets[i]:offsets[i + 1]] == 1
                    want[:len(conv)][carry] = conv[carry]
                    assert targets[row].tolist() == want[1:].tolist()
                    assert inputs[row, :len(conv)].tolist() == conv.tolist()[:64]
                    assert (inputs[row, len(conv):] == pad).all()
                counted += int((targets != IGNORE).sum())
        assert ranks[0].step_targets == ranks[1].step_targets == counted > 0


def test_loader_resumes_mid_epoch(prepared):
    first = loader(prepared, dp=1, accum=4)  # 12 samples a step: an epoch of ~43 ends inside step 4
    steps = [first.next_step() for _ in range(6)]
    again = loader(prepared, dp=1, accum=4)
    again.load_state_dict(json.loads(json.dumps(loader_state_after(prepared, 3))))
    for want in steps[3:]:
        got = again.next_step()
        assert all(torch.equal(a, b) for pa, pb in zip(want, got) for a, b in zip(pa, pb))


def loader_state_after(prepared, steps: int) -> dict:
    lo = loader(prepared, dp=1, accum=4)
    for _ in range(steps):
        lo.next_step()
    return lo.state_dict()


def test_mask_changes_nothing_where_it_is_zero(prepared):
    """Labels changed at masked positions: loss and gradients bitwise equal; changed at one
    unmasked position: the loss differs."""
    from spec.config_model import ModelConfig
    from train.model import build_model, materialise
    from train.strategies.base import loss_fn

    tokens, mask, offsets = split_arrays(prepared, "train")
    lo = loader(prepared, dp=1, accum=1)
    ids = lo.stream(0, 3)
    (inputs, targets), = lo.next_step()
    labels, carries = torch.zeros(3, 64, dtype=torch.int64), torch.zeros(3, 64, dtype=torch.bool)
    for row, i in enumerate(ids):  # the conversation's tokens and mask, shifted by one
        n = min(int(offsets[i + 1] - offsets[i]), 65) - 1
        labels[row, :n] = torch.from_numpy(tokens[offsets[i] + 1:offsets[i] + 1 + n].astype(np.int64))
        carries[row, :n] = torch.from_numpy(mask[offsets[i] + 1:offsets[i] + 1 + n] == 1)
    assert torch.equal(masked_targets(labels, carries), targets)
    model = build_model(ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=384, max_seq_len=64))
    materialise([model], 0, torch.device("cpu"))

    def loss_and_grads(lab):
        model.zero_grad()
        loss = loss_fn(model(inputs), masked_targets(lab, carries))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base = loss_and_grads(labels)
    noise = torch.randint(0, 384, labels.shape)
    masked = loss_and_grads(torch.where(carries, labels, noise))
    assert torch.equal(base[0], masked[0]) and all(torch.equal(a, b) for a, b in zip(base[1], masked[1]))
    one = labels.clone()
    r, c = carries.nonzero()[0].tolist()
    one[r, c] = (one[r, c] + 1) % 384
    changed = loss_and_grads(one)
    assert not torch.equal(base[0], changed[0]) and not all(torch.equal(a, b) for a, b in zip(base[1], changed[1]))
