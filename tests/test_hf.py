"""Hugging Face Llama and Qwen weights in and out, checked against ``transformers`` itself.

- import: a tiny random ``LlamaForCausalLM`` saved by transformers, loaded into our model:
  logits equal transformers' within 1e-4 (fp32) for plain attention, GQA, tied
  embeddings and Llama 3's rope_scaling, and for a Qwen2 (q/k/v biases, tied) and a
  Qwen3 (q/k norms, heads wider than hidden/heads) built from their configs; the
  dimensions come from its config.json;
- bad input: an explicit override that disagrees, a missing or misshapen tensor, another
  architecture, sliding-window attention: one line naming it, exit 2, nothing written;
- every strategy loads it: imported, one step at a learning rate too small to move a
  weight, exported: every tensor equal to the original (bitwise; a Qwen export is the
  same architecture to transformers);
- trained under FSDP, ZeRO-3 and TP, exported, loaded by transformers: its logits equal
  ours from the run's own checkpoint.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import warm
from conftest import REPO, run_dir_of
from warm import launcher  # forked from one process that imported torch once (tests/warm.py)
from spec.config import ConfigError, RunConfig
from spec.hf import apply_hf_model

transformers = pytest.importorskip("transformers")  # a test dependency (the dev extra)

SHAPES = {
    "plain": {},
    "gqa": {"num_key_value_heads": 2},
    "tied": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    "rope_scaling": {"num_key_value_heads": 2, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}},
    # Qwen2.5's small models: q/k/v biases, tied embeddings; Qwen3: q/k norms, heads wider than dim/heads.
    "qwen2": {"family": "Qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3": {"family": "Qwen3", "num_key_value_heads": 2, "head_dim": 32},
    "qwen2_untied": {"family": "Qwen2", "num_key_value_heads": 2},  # Qwen2.5 7B's: biases sharded under TP
}
RUN = ["train.seq_len=32", "data.num_tokens=50000", "checkpoint.save_final=true"]


def _save_hf(path: Path, seed: int = 0, family: str = "Llama", **extra) -> Path:
    torch.manual_seed(seed)
    shape = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 256, "max_position_embeddings": 128, **extra}
    cfg = getattr(transformers, f"{family}Config")(**shape)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    if family != "Llama":  # transformers starts biases at 0 and norms at 1: make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                    p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: _save_hf(root / name, seed=i, **extra) for i, (name, extra) in enumerate(SHAPES.items())}


def _ours(hf_path: Path):
    from train.model import build_model, materialise

    cfg = RunConfig()
    cfg.model.hf_path = str(hf_path)
    apply_hf_model(cfg, [])
    model = build_model(cfg.model)
    materialise([model], 0, torch.device("cpu"), cfg.model.hf_path)
    return cfg, model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_matches_transformers(hf_dirs, shape):
    cfg, ours = _ours(hf_dirs[shape])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[shape]).eval()
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
    assert cfg.model.name == shape and cfg.model.dim == 64 and cfg.model.ffn_hidden_dim == 160
    assert cfg.model.n_kv_heads == (None if shape == "plain" else 2)
    assert cfg.model.tie_embeddings == (shape in ("tied", "qwen2"))
    assert (cfg.model.qkv_bias, cfg.model.qk_norm, cfg.model.head_dim) == (
        shape.startswith("qwen2"), shape == "qwen3", 32 if shape == "qwen3" else None)
    assert cfg.model.rope_scaling.type == ("llama3" if shape == "rope_scaling" else None)


def _refusal(hf_path, overrides=()):
    cfg = RunConfig()
    cfg.model.hf_path = str(hf_path)
    with pytest.raises(ConfigError) as err:
        apply_hf_model(cfg, list(overrides))
    return str(err.value)


def test_bad_checkpoints_are_refused_naming_what_is_wrong(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_dirs["gqa"]
    msg = _refusal(src, ["model.dim=128"])
    assert "model.dim=128 disagrees" in msg and "hidden_size=64" in msg
    cfg = RunConfig()
    cfg.model.hf_path = str(src)
    apply_hf_model(cfg, ["model.dim=64", "train.steps=3"])  # agreeing overrides are fine
    assert cfg.model.dim == 64

    weights = load_file(src / "model.safetensors")
    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, broken / "model.safetensors")
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in _refusal(broken)

    save_file({**weights, "model.norm.weight": torch.ones(32)}, broken / "model.safetensors")
    assert "tensor model.norm.weight has shape [32], the config.json's model needs [64]" in _refusal(broken)

    config = json.loads((src / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                    "architectures": ["MistralForCausalLM"]}))
    assert "is not supported; only Llama" in _refusal(broken)
    assert "no config.json there" in _refusal(tmp_path)
    assert "no such directory" in _refusal(tmp_path / "nowhere")


SLIDING = [({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True; only False is supported; "
             "full attention only"),
           ({"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types[1]='sliding_attention'; full attention only"),
           ({"attention_bias": True}, "attention_bias=True; only False is supported"),
           ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
            "only Llama, Qwen2 / Qwen2.5 and Qwen3")]


@pytest.mark.parametrize("change,refusal", SLIDING,
                         ids=["use_sliding_window", "layer_types", "qwen3_o_bias", "mistral"])
def test_what_qwen_configs_we_do_not_build_is_refused(hf_dirs, change, refusal):
    from spec.hf import model_fields

    config = json.loads((hf_dirs["qwen3"] / "config.json").read_text())
    assert model_fields(config)["qk_norm"]
    with pytest.raises(ConfigError) as err:
        model_fields({**config, **change}, "q3")
    assert str(err.value).startswith("model.hf_path=q3: ") and refusal in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields,refusal", [
    ({"head_dim": 7}, "model head dim 7 (model.head_dim"), ({"dim": 60, "n_heads": 8, "head_dim": 32}, None),
    ({"qkv_bias": True, "qk_norm": True}, "model.qkv_bias=true with model.qk_norm=true")])
def test_head_width_and_qwen_flags_are_validated(fields, refusal):
    from spec.validate import validate

    cfg = RunConfig()
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    if refusal is None:  # a head_dim of its own needs no dim divisible by n_heads
        return validate(cfg)
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        validate(cfg)


def test_cli_refusal_writes_nothing(hf_dirs, tmp_path):
    proc = launcher([f"model.hf_path={hf_dirs['plain']}", "model.n_heads=8", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.n_heads=8 disagrees")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("config.yaml"))


def _export(run_dir: Path, out: Path, *extra: str) -> None:
    proc = warm.run_module("launcher.export", [str(run_dir), str(out), *extra], cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def assert_export_has_our_logits(run_dir: Path, out: Path, data: Path, vocab: int):
    """``launcher.export`` of the run to ``out`` loads in transformers with our logits at the
    run's last checkpoint (random tokens below ``vocab``), the data's tokenizer beside it and
    its EOS in config.json; the model transformers loaded."""
    _export(run_dir, out)
    assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens).logits, _ours_from_checkpoint(run_dir)(tokens)
    assert torch.allclose(got, want, rtol=0, atol=1e-4)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == json.loads(
        (data / "manifest.json").read_text())["eos_id"]
    return theirs


# Strategy, shape of the Hugging Face model, extra overrides.
# ZeRO-3 takes Qwen2 (tied as Qwen2.5's small models are, with q/k/v biases): a tied model
# starts partitioned too (train/strategies/deepspeed.py); FSDP takes Qwen3 (q/k norms, wide heads);
# TP takes Qwen2 untied (GQA, and q/k/v biases split with their columns).
ROUND_TRIPS = [("ddp", "tied", []), ("fsdp", "tied", []), ("zero3", "qwen2", []), ("tp", "qwen2_untied", []),
               ("pp", "rope_scaling", ["cluster.gpus_per_node=2"]), ("fsdp-qwen3", "qwen3", [])]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,shape,extra", ROUND_TRIPS, ids=[c[0] for c in ROUND_TRIPS])
def test_import_then_export_gives_back_the_tensors(hf_dirs, tmp_path, strategy, shape, extra):
    """optim.lr=1e-30 moves no fp32 weight (updates ~1e-30 against weights ~1e-2)."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = launcher([f"+strategy={strategy.split('-')[0]}", f"model.hf_path={hf_dirs[shape]}", "train.steps=1",
                     "optim.lr=1e-30",
                     *RUN, *extra, f"launcher.run_dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _export(run, tmp_path / "out")
    original, exported = load_file(hf_dirs[shape] / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    if shape.startswith("qwen"):  # config.json names the architecture again: transformers builds the same model
        tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
        back, start = (transformers.AutoModelForCausalLM.from_pretrained(p).eval()
                       for p in (tmp_path / "out", hf_dirs[shape]))
        assert type(back) is type(start) and back.config.tie_word_embeddings == start.config.tie_word_embeddings
        with torch.no_grad():
            assert torch.equal(back(tokens).logits, start(tokens).logits)


def _ours_from_checkpoint(run_dir: Path):
    from spec.config import to_run_config
    from train.checkpoint.manifest import find_latest
    from train.hf_io import dcp_source, deepspeed_source
    from train.model import build_model

    cfg = to_run_config(run_dir / "config.yaml")
    ckpt = find_latest(run_dir / "checkpoints", print)
    shapes, read = (deepspeed_source if (ckpt / "deepspeed").is_dir() else dcp_source)(ckpt)
    model = build_model(cfg.model)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(read(list(shapes)), strict=not cfg.model.tie_embeddings)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero3", "tp"])
def test_trained_export_loads_in_transformers_with_our_logits(hf_dirs, tmp_path, strategy):
    run = tmp_path / "run"
    proc = launcher([f"+strategy={strategy}", f"model.hf_path={hf_dirs['gqa']}", "train.steps=3", *RUN,
                     f"launcher.run_dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    _export(run, out, "--max-shard-size", "100000")  # ~0.5 MB of weights: several shards and an index
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file(), shards
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = _ours_from_checkpoint(run)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["gqa"]).eval()
    with torch.no_grad():
        assert not torch.allclose(start(tokens).logits, want, atol=1e-4)  # the export holds the trained weights
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2


def test_a_tied_head_stays_the_embedding_after_materialisation():
    """``to_empty`` gives every module a tensor of its own: before the retie the head of a
    tied model (gpt2_124m, llama3_1b) was uninitialised memory, not the embedding."""
    from spec.config import ModelConfig
    from train.model import build_model, materialise

    model = build_model(ModelConfig(tie_embeddings=True))
    materialise([model], 0, torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters(remove_duplicate=False))) - 1
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()
