"""``+experiment=r1_distill_sft`` is open-r1's distillation SFT recipe:
every setting checked against open-r1's own files, kept as they are under tests/fixtures/
(huggingface/open-r1 at 33f84def0d20f5abc5281804f7fc91fbf276850c, Apache-2.0:
recipes/OpenR1-Distill-7B/sft/config_distill.yaml and recipes/accelerate_configs/zero3.yaml),
and the dry run of the one command shows the global batch, the schedule and the memory plan;
the planner refuses what cannot fit, naming what can."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO
from helpers import compose_run
import warm

FIXTURES = Path(__file__).parent / "fixtures"
RECIPE = yaml.safe_load((FIXTURES / "open_r1_config_distill.yaml").read_text())
ACCELERATE = yaml.safe_load((FIXTURES / "open_r1_zero3.yaml").read_text())
TEMPLATE = REPO / "conf" / "experiment" / "r1_distill_sft.chat_template.jinja"


def test_every_setting_is_the_recipes():
    cfg = compose_run(["+cluster=h100x8", "+experiment=r1_distill_sft"])
    t, o, s = cfg.train, cfg.optim, cfg.strategy
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    assert RECIPE["model_name_or_path"].endswith("Qwen2.5-Math-7B-RoPE-300k") and cfg.model.name == "qwen2_5_math_7b"
    assert (cfg.model.rope_theta, cfg.model.max_seq_len, cfg.model.qkv_bias) == (300000.0, 32768, True)
    assert (t.seq_len, t.micro_batch_size, t.grad_accum, t.epochs, t.seed) == (
        RECIPE["max_length"], RECIPE["per_device_train_batch_size"], RECIPE["gradient_accumulation_steps"],
        RECIPE["num_train_epochs"], RECIPE["seed"])
    assert RECIPE["max_steps"] == -1 and t.eval_every == 0 and RECIPE["do_eval"] is False
    assert (o.lr, o.warmup_ratio, o.grad_clip) == (RECIPE["learning_rate"], RECIPE["warmup_ratio"],
                                                    RECIPE["max_grad_norm"])
    assert RECIPE["lr_scheduler_type"] == "cosine_with_min_lr" and o.min_lr_ratio == RECIPE["lr_scheduler_kwargs"][
        "min_lr_rate"]
    # what the recipe leaves to transformers' TrainingArguments: AdamW's defaults, no weight decay
    assert (o.beta1, o.beta2, o.eps, o.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert RECIPE["bf16"] and RECIPE["torch_dtype"] == "bfloat16" and s.mixed_precision == "bf16"
    assert RECIPE["gradient_checkpointing"] and s.activation_checkpointing == "full"
    assert RECIPE["packing"] is cfg.data.packing is False and cfg.data.source == "chat"  # one conversation a sequence
    ds = ACCELERATE["deepspeed_config"]
    assert (s.engine, s.zero_stage, ACCELERATE["distributed_type"]) == ("deepspeed", ds["zero_stage"], "DEEPSPEED")
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none" and not s.offload_optimizer
    assert ACCELERATE["num_processes"] == world == 8 and ACCELERATE["mixed_precision"] == "bf16"
    # the recipe's chat template, shipped beside it (its first line a comment naming the source)
    assert TEMPLATE.read_text().split("\n", 1)[1] == RECIPE["chat_template"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """The shipped conversations prepared as the recipe trains (the recipe's template, its EOS,
    the loss on every token: TRL's SFTTrainer default for `messages`, assistant_only_loss=False)."""
    from train.data.prepare import main

    work = tmp_path_factory.mktemp("r1")
    out, convs = work / "data", work / "conversations.jsonl"
    no_system = {"messages": [{"role": "user", "content": "why is the sky blue?"},
                              {"role": "assistant", "content": "light on the sun."}]}  # the template adds its own
    convs.write_text((FIXTURES / "chat" / "conversations.jsonl").read_text() + json.dumps(no_system) + "\n")
    assert main([str(convs), "--tokenizer", str(FIXTURES / "chat" / "qwen"),
                 "--chat", "--loss-on", "all", "--chat-template", str(TEMPLATE), "--eos", RECIPE["eos_token"],
                 "--out", str(out), "--no-progress"]) == 0
    return out


def _conversations(path: Path) -> list:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def test_prepare_renders_with_the_recipes_template(chat_dir):
    assert (chat_dir / "chat_template.jinja").read_text() == TEMPLATE.read_text()
    info = json.loads((chat_dir / "manifest.json").read_text())
    assert info["chat_template"] == str(TEMPLATE.resolve()) and info["loss_on"] == "all"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    text = "".join(tok.decode(np.fromfile(chat_dir / f"{split}.bin", dtype=info["dtype"]).tolist(),
                              skip_special_tokens=False) for split in ("train", "val"))
    convs = _conversations(chat_dir.parent / "conversations.jsonl")
    own = sum(m[0]["role"] == "system" for m in convs)
    assert own < len(convs) == info["conversations"]
    # the template's own system prompt where a conversation brings none, theirs where it does
    assert text.count("<|im_start|>system\nYou are Open-R1, a language model trained by Hugging Face") == len(convs) - own
    assert text.count("<|im_start|>system\n") == len(convs)


def test_the_one_command_shows_batch_schedule_and_memory(tmp_path, chat_dir):
    proc = warm.launcher(["+cluster=h100x8", "+experiment=r1_distill_sft", f"data.path={chat_dir}",
                          "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "global batch: 128 sequences = 4,194,304 tokens per step (micro 2 x accum 8 x dp 8" in out
    train = json.loads((chat_dir / "manifest.json").read_text())["splits"]["train"]["documents"]
    assert f"schedule: samples per epoch {train} " in out and "(train.epochs=5)" in out, out[-1500:]
    assert "(optim.warmup_ratio=0.03)" in out
    plan = next(line for line in out.splitlines() if line.startswith("memory plan: "))
    assert "GB per GPU of 80 (fits;" in plan and "activation_checkpointing=full" in plan, plan


def test_what_cannot_fit_is_refused_naming_what_can(tmp_path, chat_dir):
    proc = warm.launcher(["+cluster=h100x8", "+experiment=r1_distill_sft", f"data.path={chat_dir}",
                          "cluster.gpu_mem_gb=40", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode != 0 and "cluster.gpu_mem_gb=40: qwen2_5_math_7b with strategy zero3 is predicted" in \
        proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "in place of +strategy=zero3" in proc.stderr + proc.stdout and not (tmp_path / "runs").exists()


def test_the_planner_weighs_every_strategy_against_the_recipe():
    """The recipe chooses zero3 in its defaults: the planner's other strategies override that
    choice (strategy=NAME, Hydra's rule) rather than adding a second value (+strategy=NAME)."""
    proc = warm.run_module("launcher.plan", ["+cluster=h100x8", "+experiment=r1_distill_sft", "plan.format=json"],
                           cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = [row["strategy"] for row in json.loads(proc.stdout)]
    assert len(names) == len(set(names)) and {"zero3", "fsdp", "ddp"} <= set(names), names
