"""The small defects a new user met on the first day, one test each.

The planner's exit status (text and JSON alike where nothing fits) is tested in
tests/test_plan.py (``test_nothing_runnable_exits_1_with_the_reason_in_text_and_json``).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, launcher
from warm import pythonpath
from helpers import compose_run
from spec.config import CheckpointConfig, ConfigError
from spec.rundir import latest_checkpoint
from spec.validate import validate

TINY = ["cluster.gpus_per_node=1", "train.seq_len=32", "data.num_tokens=50000"]


def _left(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- the last step of a finished run is in a checkpoint -----------------------------------

def test_save_final_follows_periodic_checkpoints_unless_given():
    from train.checkpoint.policy import saves_last_step

    assert CheckpointConfig().save_final is None  # null: decided by the periodic saves
    assert not saves_last_step(CheckpointConfig())
    assert saves_last_step(CheckpointConfig(every_steps=3))
    assert saves_last_step(CheckpointConfig(every_minutes=5.0))
    assert not saves_last_step(CheckpointConfig(every_steps=3, save_final=False))  # keeps its meaning
    assert saves_last_step(CheckpointConfig(save_final=True))


@pytest.mark.slow
def test_a_finished_run_with_periodic_checkpoints_saves_its_last_step(tmp_path):
    run = tmp_path / "run"
    proc = launcher([*TINY, "train.steps=5", "checkpoint.every_steps=2", f"launcher.run_dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert latest_checkpoint(run)["step"] == 5  # not 4, the last periodic save


# --- a value of the wrong type: one line, exit 2, nothing left ----------------------------

@pytest.mark.parametrize("args, words", [
    (["cluster.nodes=abc"], "cluster.nodes=abc: cluster.nodes takes an integer, not 'abc'; e.g. cluster.nodes=1"),
    (["train.steps=1.5"], "train.steps takes an integer, not 1.5"),
    (["checkpoint.save_final=maybe"], "checkpoint.save_final takes true or false or null, not 'maybe'"),
])
def test_a_value_of_the_wrong_type_is_one_line_and_exit_2(tmp_path, args, words):
    proc = launcher(args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert _left(tmp_path) == []


def test_values_that_convert_are_accepted(tmp_path):
    from launcher.overrides import check_overrides

    check_overrides(["cluster.nodes='2'", "optim.lr=1", "checkpoint.save_final=null", "model.n_kv_heads=null",
                     "launcher.run_dir=3", "cluster.env.X=1", "cluster.nodes=1,2"], multirun=True)
    # in a sweep a value of the wrong type is its point's to skip, the others submitted
    # (tests/test_sweep_arrays.py, on the local cluster)
    check_overrides(["train.seed=1,oops", "cluster.nodes=1,abc"], multirun=True)


# --- a refused command leaves no directory, from a git checkout or not --------------------

@pytest.mark.parametrize("git", [True, False])
def test_a_refused_command_leaves_no_directory(tmp_path, git):
    cwd, root = tmp_path / "work", tmp_path / "elsewhere" / "runs"
    cwd.mkdir()
    if git:
        subprocess.run(["git", "init", "-q", str(cwd)], check=True)
    kept = tmp_path / "mine"  # a root the user made: it stays
    kept.mkdir()
    for extra in ([f"launcher.root={root}"], [f"launcher.root={kept}"], [f"launcher.run_dir={root}/a/b"], []):
        proc = launcher(["cluster.nodes=0", *extra], cwd=cwd)
        assert proc.returncode == 2 and "cluster.nodes=0 must be >= 1" in proc.stderr, proc.stderr
    assert [p for p in _left(tmp_path) if not p.startswith("work/.git")] == ["mine", "work"]


# --- launcher.resume RUN_DIR launcher.wait=true waits, as --wait does ---------------------

def test_resume_honours_launcher_wait(tmp_path, monkeypatch):
    import launcher.relaunch as relaunch
    from spec.config import to_yaml

    cfg = compose_run(["+cluster=localslurm"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    asked = []
    monkeypatch.setattr(relaunch, "start", lambda session, point, wait, convert=None: asked.append(wait) or 0)
    for args in (["launcher.wait=true"], [], ["--wait"], ["launcher.wait=false"]):
        assert relaunch.main([str(tmp_path), *args]) == 0
    assert asked == [True, False, True, False]


# --- optim.lr=0 is accepted, as torch accepts it ------------------------------------------

def test_a_learning_rate_of_zero_is_accepted():
    validate(compose_run(["optim.lr=0"]))
    with pytest.raises(ConfigError, match=r"optim.lr=-0.1 must be >= 0"):
        validate(compose_run(["optim.lr=-0.1"]))


# --- DeepSpeed's CPU op links under a path with a space ------------------------------------

def test_torch_libraries_are_linked_through_a_path_without_spaces(tmp_path):
    """A venv reached through a path with a space (a symlink to this one: torch's module
    paths then hold the space, as in a checkout under such a path): the directory the JIT
    build links against has none, and is torch's lib directory."""
    spaced = tmp_path / "a checkout" / "venv"
    spaced.parent.mkdir()
    spaced.symlink_to(Path(sys.prefix))
    code = ("import os; from torch.utils import cpp_extension as c; from train.torch_compat import "
            "link_path_without_spaces as f; lib = c.TORCH_LIB_PATH; link = f(); "
            "print(' ' in lib, ' ' in c.TORCH_LIB_PATH, link == c.TORCH_LIB_PATH, os.path.samefile(lib, link))")
    proc = subprocess.run([str(spaced / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "True", "True"]


def test_a_path_without_spaces_is_left_alone():
    from train.torch_compat import link_path_without_spaces

    if " " in str(Path(sys.prefix)):
        pytest.skip("this venv's own path holds a space")
    assert link_path_without_spaces() is None


# --- activation checkpointing modes: one table, "selective" an alias of every_other --------

def test_checkpointing_modes_are_one_table_with_the_old_name_kept():
    from spec.ac_modes import ac_mode
    from launcher.plan.memory import estimate
    from spec.layout import build_layout

    assert ac_mode("selective") is ac_mode("every_other")
    assert [i for i in range(5) if ac_mode("every_other").recomputes(i)] == [0, 2, 4]
    assert [ac_mode(m).blocks(5) for m in ("none", "every_other", "full")] == [0, 3, 5]
    for name in ("none", "every_other", "selective", "full"):
        validate(compose_run([f"strategy.activation_checkpointing={name}"]))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        validate(compose_run(["strategy.activation_checkpointing=op_selective"]))
    old, new = (compose_run(["+model=llama3_8b", "+cluster=h100x8", f"strategy.activation_checkpointing={m}"])
                for m in ("selective", "every_other"))
    assert estimate(old, build_layout(old)).total_bytes == estimate(new, build_layout(new)).total_bytes
    # the mode names are strings of the table's module only
    named = [str(p.relative_to(REPO)) for room in ("spec", "train", "launcher") for p in (REPO / room).rglob("*.py")
             if any(isinstance(n, ast.Constant) and n.value in ("selective", "every_other")
                    for n in ast.walk(ast.parse(p.read_text())))]
    assert named == ["spec/ac_modes.py"]


def test_every_other_wraps_blocks_0_2_4():
    from train.model import build_model
    from train.parallelize import apply_activation_checkpointing

    for mode in ("every_other", "selective"):
        model = build_model(compose_run(["model.n_layers=5"]).model)
        apply_activation_checkpointing(model, mode)
        wrapped = [i for i, block in enumerate(model.layers.values()) if "Checkpoint" in type(block).__name__]
        assert wrapped == [0, 2, 4]


# --- the Makefile says how many pytest processes `make test` runs --------------------------

def test_makefile_counts_the_suites_pytest_processes():
    runs = len(re.findall(r'"\$PY" -m pytest', (REPO / "tests" / "run_suite.sh").read_text()))
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    comment = " ".join(line.lstrip("# ") for line in (REPO / "Makefile").read_text().splitlines()
                       if line.startswith("## "))
    assert f"{words[runs]} pytest processes" in comment, runs


# --- the built-in trainer's schedule is refused for a script, not ignored -------------------

@pytest.mark.parametrize("field", ["train.epochs=2", "optim.warmup_ratio=0.1"])
def test_a_scripts_run_refuses_the_trainers_schedule_fields(tmp_path, field):
    """A script given by entrypoint= runs its own loop: train.epochs and optim.warmup_ratio
    would do nothing there, so the launch says so in one line and leaves nothing behind."""
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    proc = launcher([f"entrypoint={script}", field, *TINY], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {field}") and "entrypoint_args" in line, line
    assert _left(tmp_path) == ["train.py"]


# --- model.head_dim given as the checkpoint's implied width agrees with it ----------------

def test_head_dim_equal_to_the_checkpoints_implied_width_is_accepted(tmp_path):
    """config.json without head_dim has heads hidden_size / num_attention_heads wide: a
    model.head_dim of that width agrees with it; another width is refused naming the width
    the checkpoint implies (it said head_dim=None, which misled)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from spec.config import ModelConfig, RunConfig
    from spec.hf import apply_hf_model, expected_shapes, hf_config

    m = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_hidden_dim=96, max_seq_len=64)
    config = hf_config(m)
    config.pop("head_dim", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: np.zeros(v, np.float32) for k, v in expected_shapes(m).items()}, str(tmp_path / "model.safetensors"))

    def apply(head_dim: int) -> RunConfig:
        cfg = RunConfig()
        cfg.model.hf_path, cfg.model.head_dim = str(tmp_path), head_dim
        apply_hf_model(cfg, [f"model.head_dim={head_dim}"])
        return cfg

    assert apply(16).model.n_heads == 4
    with pytest.raises(ConfigError, match=r"^model.head_dim=32 disagrees .*\(head_dim=16\)"):
        apply(32)


# --- evaluation needs validation data, checked at launch -----------------------------------

def test_evaluation_without_a_validation_target_is_refused_at_launch(tmp_path):
    """Chat data whose validation conversations lost every assistant token to --max-length
    has nothing to evaluate (the loss is divided by its count of targets: 0): with
    train.eval_every > 0 the launch says so in one line; with eval_every=0 it passes."""
    import json

    from spec.data import check_data
    from test_chat_data import run_prepare

    data, manifest = run_prepare(tmp_path, "--max-length", "65")
    manifest["splits"]["val"]["loss_tokens"] = 0  # as a short --max-length leaves it
    (data / "manifest.json").write_text(json.dumps(manifest))
    cfg = compose_run(["data.source=chat", f"data.path={data}", "model.vocab_size=512", "train.eval_every=5"])
    with pytest.raises(ConfigError, match=r"^train.eval_every=5: data.path=.* holds 0 tokens carrying loss .*"
                                          r"--val-fraction .*, or set train.eval_every=0$"):
        check_data(cfg)
    cfg.train.eval_every = 0
    check_data(cfg)
