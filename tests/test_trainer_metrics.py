"""A user's transformers ``Trainer`` / TRL ``SFTTrainer`` script, unchanged, under the
harness: its logs become metrics.jsonl rows (train/harness/hf_trainer.py), so status,
the summary and the reports see its steps, loss and throughput; on the local cluster a
preempted TRL run resumes from its own checkpoint with each step's row once (stitched)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO, launcher, run_dir_of, submit_run, wait_until
from launcher.track import status
from launcher.track.scaling import stitch
from spec.rundir import read_metrics, read_run_json
from train import session
from train.harness import hf_trainer

SCRIPT = REPO / "tests" / "fixtures" / "hf_trainer.py"
# pyproject's dev extra brings TRL where it installs (Python >= 3.11)
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (Python < 3.11)")


# --- the callback's rows, driven by hand (no transformers) ---------------------------------

@pytest.fixture
def bound(tmp_path):
    """A session as the harness binds it for rank 0 of 2, segment 3."""
    session._bind(session._State(tmp_path, 0, 2, 3, SimpleNamespace(code=0)))
    yield tmp_path
    session._bind(None)


def _args(**kw):
    return SimpleNamespace(**{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 2,
                              **kw})


def test_each_training_log_is_one_row_with_the_steps_rates(bound):
    rows, args = hf_trainer.TrainerRows(), _args()
    state = SimpleNamespace(global_step=10, num_input_tokens_seen=5000)  # resumed at step 10
    no_eval = SimpleNamespace(should_evaluate=False)
    rows.on_train_begin(args, state, no_eval)
    for step in (11, 12):
        state.global_step, state.num_input_tokens_seen = step, state.num_input_tokens_seen + 256
        rows.on_log(args, state, no_eval, logs={"loss": 2.0 / step, "learning_rate": 1e-3, "grad_norm": 0.5,
                                                "epoch": step / 20, "mean_token_accuracy": 0.25})
    rows.on_log(args, state, no_eval, logs={"train_runtime": 3.0, "train_loss": 0.2, "epoch": 0.6})  # summary
    got = read_metrics(bound)
    assert [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["segment"], r["world_size"]) for r in got] == \
        [(11, 2.0 / 11, 1e-3, 0.5, 3, 2), (12, 2.0 / 12, 1e-3, 0.5, 3, 2)]
    assert all(r["global_batch_size"] == 16 and r["tokens_per_step"] == 256 and r["tokens_per_s"] > 0
               and r["samples_per_s"] > 0 and r["mean_token_accuracy"] == 0.25 for r in got), got
    assert got[1]["epoch"] == 0.6 and "learning_rate" not in got[1] and got[1]["mfu"] is None


def test_a_signal_has_the_trainer_save_at_that_step_and_the_script_end_after_it(tmp_path):
    """No signal: the Trainer's controls stay as they are and a periodic save goes on. A
    signal (USR2's code 2): the step's end asks a save and the loop's end, the save ends
    the script (Preempted, which the harness records as the interruption) with the
    step's pending row written first."""
    from train.harness.preempt import Preempted

    flag = SimpleNamespace(code=0, agreed_requeue=False)
    session._bind(session._State(tmp_path, 0, 1, 1, flag))
    try:
        rows, args = hf_trainer.TrainerRows(), _args()
        state = SimpleNamespace(global_step=5, num_input_tokens_seen=0)
        control = SimpleNamespace(should_save=False, should_training_stop=False, should_evaluate=True)
        rows.on_train_begin(args, state, control)
        rows.on_step_end(args, state, control)
        rows.on_save(args, state, control)  # a periodic save: training goes on
        assert (control.should_save, control.should_training_stop) == (False, False)
        state.global_step, flag.code = 6, 2
        rows.on_log(args, state, control, logs={"loss": 1.5, "learning_rate": 1e-3})  # waits for an evaluation
        rows.on_step_end(args, state, control)
        assert (control.should_save, control.should_training_stop, flag.agreed_requeue) == (True, True, True)
        with pytest.raises(Preempted, match="checkpoint of step 6"):
            rows.on_save(args, state, control)
        assert [r["step"] for r in read_metrics(tmp_path)] == [6]
    finally:
        session._bind(None)


def test_an_evaluation_joins_its_steps_row_and_a_later_one_adds_none(bound):
    rows, args = hf_trainer.TrainerRows(), _args()
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    rows.on_train_begin(args, state, SimpleNamespace())
    state.global_step = 1
    rows.on_log(args, state, SimpleNamespace(should_evaluate=True), logs={"loss": 3.0, "num_tokens": 64.0})
    assert read_metrics(bound) == []  # waits for its evaluation
    rows.on_log(args, state, SimpleNamespace(should_evaluate=True), logs={"eval_loss": 2.0})  # on_evaluate's
    rows.on_evaluate(args, state, SimpleNamespace(), metrics={"eval_loss": 2.0, "eval_runtime": 0.1})
    rows.on_train_end(args, state, SimpleNamespace())
    rows.on_evaluate(args, state, SimpleNamespace(), metrics={"eval_loss": 1.5})  # trainer.evaluate() after
    got = read_metrics(bound)
    assert [(r["step"], r["loss"], r["val_loss"], r["tokens_per_step"]) for r in got] == [(1, 3.0, 2.0, 64)], got
    assert got[0]["val_ppl"] == pytest.approx(7.389, rel=1e-3) and "eval_runtime" not in got[0]


def test_only_global_rank_0_writes_and_the_switch_turns_it_off(tmp_path, monkeypatch):
    session._bind(session._State(tmp_path, 1, 2, 1, SimpleNamespace(code=0)))
    try:
        rows, args = hf_trainer.TrainerRows(), _args()
        state = SimpleNamespace(global_step=1, num_input_tokens_seen=0)
        rows.on_train_begin(args, state, SimpleNamespace())
        rows.on_log(args, state, SimpleNamespace(should_evaluate=False), logs={"loss": 1.0})
    finally:
        session._bind(None)
    assert read_metrics(tmp_path) == []
    monkeypatch.setenv(hf_trainer.ENV, "0")
    # a finder an earlier test of this process installed (a user's code run in-process) left out
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, hf_trainer._Finder)])
    hf_trainer.install()
    assert not any(isinstance(f, hf_trainer._Finder) for f in sys.meta_path)


# --- a TRL script on 2 local ranks ------------------------------------------------------------

@needs_trl
def test_trl_script_rows_reach_metrics_status_and_summary(tmp_path, capsys):
    proc = launcher([f"entrypoint={SCRIPT}", "cluster.gpus_per_node=2",
                     "entrypoint_args=[--trl,--steps,4,--eval-steps,2]"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert all(r["segment"] == 1 and r["world_size"] == 2 and r["loss"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0
               for r in rows), rows
    # 2 ranks x 4 sequences of 16 tokens (TRL's num_tokens); the Trainer's own batch
    assert all(r["tokens_per_step"] == 128 and r["tokens_per_s"] > 0 and r["global_batch_size"] == 8 for r in rows)
    assert [r.get("val_loss") is not None for r in rows] == [False, True, False, True]
    assert rows[-1]["loss"] < rows[0]["loss"] and "mean_token_accuracy" in rows[-1]
    last = f"steps: 4  loss: {rows[0]['loss']:.4f} (step 1) -> {rows[-1]['loss']:.4f} (step 4)"
    assert last in proc.stdout and "tokens/s: " in proc.stdout, proc.stdout
    assert status.main([str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "status: completed" in shown and last in shown, shown


# --- the same script with TRL on 2 nodes of the local cluster, preempted once ---------------

@pytest.mark.slurm
@pytest.mark.slow
@needs_trl
def test_trl_run_preempted_on_slurm_resumes_from_its_checkpoint_with_each_step_once(tmp_path, slurm_cluster):
    env = slurm_cluster
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
                               f"entrypoint={SCRIPT}",
                               "entrypoint_args=[--trl,--steps,14,--save-at,4,--step-delay,0.4]"], tmp_path, env)
    # Step 6's row: checkpoint-4 (the script's only one) is saved; 8 steps left.
    wait_until(lambda: len(read_metrics(run_dir)) >= 6, 240, "6 steps of the TRL run")
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
    wait_until(lambda: read_run_json(run_dir).get("status") in ("completed", "failed", "stopped"), 300,
               f"{run_dir} to finish")
    info = read_run_json(run_dir)
    assert (info["status"], info["preemptions"], info["segments"], info["job_id"]) == ("completed", 1, 2, job), info
    out = "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*_0_log.out")))
    resumed = [int(line.rsplit("-", 1)[1]) for line in out.splitlines() if line.startswith("resumed from checkpoint-")]
    rows = read_metrics(run_dir)
    first, second = ([r for r in rows if r["segment"] == s] for s in (1, 2))
    # At the signal the Trainer saved the step it had done (not only the script's
    # checkpoint-4) and the script ended there: the second segment goes on from that step,
    # and no step is run twice.
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= 6, first
    assert resumed == [first[-1]["step"]], out
    assert (run_dir / "hf_out" / f"checkpoint-{resumed[0]}" / "trainer_state.json").is_file()
    assert [r["step"] for r in second] == list(range(resumed[0] + 1, 15)), second
    assert "done: step 14" in out and out.count("done: step") == 1, out  # the code after train() ran once
    stitched = stitch(rows)
    assert [r["step"] for r in stitched] == list(range(1, 15)) and len(rows) == 14
    assert stitched[-1]["loss"] < stitched[0]["loss"] and all(r["tokens_per_s"] > 0 for r in second)
