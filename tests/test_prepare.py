"""Real text: ``python -m train.data.prepare`` and ``data.source=tokens`` with evaluation.

- prepare: text files and JSONL with a tokenizer trained on the inputs, then the same
  with that tokenizer given as ``--tokenizer``: identical token files; every document is
  its tokens + EOS (decoded back to its text); the split is by document, seeded, and
  holds at least one document; the manifest counts what the files hold;
- bad input: a JSONL record without the field, a tokenizer path without tokenizer.json,
  a prepared vocabulary larger than the model's (refused at launch, nothing written);
- training on it with ``train.eval_every``: val_loss / val_ppl in metrics.jsonl, the
  summary and the report; killed in the middle of a save and resumed, the losses and
  validation losses equal an uninterrupted run's (the data position is exact).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, launcher
from warm import pythonpath
from spec.rundir import read_metrics

DOCS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + i)) for i in range(60)]


def prepare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.run([sys.executable, "-m", "train.data.prepare", *args, "--no-progress"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text(DOCS[0])
    (root / "b.txt").write_text(DOCS[1])
    with open(root / "rest.jsonl", "w") as f:
        for doc in DOCS[2:]:
            f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    out = root / "prepared"
    proc = prepare(str(root / "a.txt"), str(root / "b.txt"), str(root / "rest.jsonl"), "--train-tokenizer", "300",
                   "--out", str(out), "--val-fraction", "0.1", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root, out


def test_prepared_files_hold_every_document_with_eos(corpus):
    from tokenizers import Tokenizer

    root, out = corpus
    info = json.loads((out / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert info["vocab_size"] == tok.get_vocab_size() == 300 and info["dtype"] == "uint16"
    eos = info["eos_id"]
    assert tok.id_to_token(eos) == "<|endoftext|>"
    splits = {name: np.fromfile(out / f"{name}.bin", dtype=np.uint16) for name in ("train", "val")}
    docs = {name: [d for d in np.split(arr, np.flatnonzero(arr == eos) + 1) if len(d)] for name, arr in splits.items()}
    for name in ("train", "val"):
        assert info["splits"][name]["tokens"] == len(splits[name])
        assert info["splits"][name]["documents"] == len(docs[name]) and all(d[-1] == eos for d in docs[name])
    assert 1 <= len(docs["val"]) < 20 and len(docs["train"]) + len(docs["val"]) == len(DOCS)
    decoded = sorted(tok.decode(d[:-1].tolist()) for split in docs.values() for d in split)
    assert decoded == sorted(DOCS)


def test_a_given_tokenizer_gives_the_same_files(corpus, tmp_path):
    root, out = corpus
    again = tmp_path / "again"
    proc = prepare(str(root / "a.txt"), str(root / "b.txt"), str(root / "rest.jsonl"), "--tokenizer",
                   str(out / "tokenizer.json"), "--out", str(again), "--val-fraction", "0.1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    info = json.loads((again / "manifest.json").read_text())
    assert info["tokenizer"] == str((out / "tokenizer.json").resolve())
    assert "tokens/s" in proc.stdout


def test_bad_inputs_are_named(corpus, tmp_path):
    root, out = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    proc = prepare(str(bad), "--tokenizer", str(out), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode != 0 and "bad.jsonl:1 has no field 'text'; name it with --field" in proc.stderr
    proc = prepare(str(bad), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode != 0 and "no tokenizer.json there" in proc.stderr
    refused = launcher(["data.source=tokens", f"data.path={out}", "model.vocab_size=256", "launcher.dry_run=true",
                        f"launcher.run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert refused.returncode == 2
    assert "vocabulary (300) is larger than model.vocab_size=256" in refused.stderr
    assert not (tmp_path / "run").exists()


TRAIN = ["data.source=tokens", "model.vocab_size=320", "train.steps=8", "train.seq_len=16",
         "train.micro_batch_size=4", "train.eval_every=4", "checkpoint.every_steps=4"]


@pytest.mark.slow
def test_training_on_prepared_text_evaluates_and_resumes_exactly(corpus, tmp_path):
    _, out = corpus
    args = TRAIN + [f"data.path={out}"]
    ref = launcher(args + [f"launcher.run_dir={tmp_path / 'ref'}"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    rows = read_metrics(tmp_path / "ref")
    vals = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    assert sorted(vals) == [4, 8] and vals[8] < vals[4]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"])) for r in rows if r.get("val_loss"))
    assert "val loss:" in ref.stdout
    killed = launcher(args + ["fault.kill_in_save_at_step=8", "checkpoint.save_final=true",
                              f"launcher.run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert killed.returncode != 0
    again = launcher(args + ["checkpoint.save_final=true", f"launcher.run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr

    def curve(run):
        return {r["step"]: (r["loss"], r.get("val_loss")) for r in read_metrics(run)}
    assert curve(tmp_path / "run") == curve(tmp_path / "ref")
