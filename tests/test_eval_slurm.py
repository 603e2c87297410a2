"""Evaluation jobs (eval.on_checkpoint, launcher/evaljobs.py, train/eval_job.py) on the real
local cluster: a 2-node run of 20 steps saving every 5 (checkpoint.keep=1), preempted once
by the high partition, gets one evaluation job per checkpoint (submitted by the batch
script's loop; they run beside the training where the pair's nodes have CPUs left, else
after it, and a preemption requeues them too), one eval.jsonl row per step and task, none
twice, none missed; the validation loss rows equal the trainer's ``train.eval_every=5`` at
the same steps; ``launcher.eval`` evaluates the last step again as a job of its own;
``launcher.then=[export,eval,"cmd:..."]`` waits on the run (afterok, in
``scontrol show job``), exports a model with the trainer's logits, finds the last step
evaluated already, and runs the command on the export. Without
Slurm: the refusals, the queue's once-only and pinning rules, the batch script."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, final_states, job_gone, submit_run, wait_until
from helpers import compose_run
from launcher import eval as launcher_eval
from launcher import evaljobs
from launcher.track import report
from spec import evals
from spec.config import ConfigError
from spec.rundir import read_metrics, read_run_json

CMD = "cmd:ls {export_dir} > {run_dir}/listing.txt"
WORDS = [{"prompt": f"Document {i}: word{(i * 7) % 50}", "choices": [f" word{(i * 7 + 1) % 50}", " zebra", " x"],
          "label": 0} for i in range(12)]


def write_task(root) -> str:
    """An lm-eval multiple-choice task over a local JSONL (read offline): its YAML's path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "words.jsonl").write_text("".join(json.dumps(w) + "\n" for w in WORDS))
    (root / "sto_words.yaml").write_text(
        "task: sto_words\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'words.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    return str(root / "sto_words.yaml")


def test_evaluations_are_refused_when_they_cannot_run_and_queued_once(tmp_path, monkeypatch):
    task = write_task(tmp_path / "task")
    for overrides, says in ((["eval.on_checkpoint=true", f"eval.tasks=[{task}]"], "evaluations are Slurm jobs"),
                            (["+cluster=localslurm", "eval.on_checkpoint=true"], "eval.tasks=[]"),
                            (["+cluster=localslurm", "eval.on_checkpoint=true", "eval.tasks=[/no/such.yaml]"],
                             "/no/such.yaml is not a file"),
                            (["+cluster=localslurm", "eval.on_checkpoint=true", f"eval.tasks=[{task}]"],
                             "lm-eval needs the model's tokenizer, and data.source=markov")):
        with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
            evaljobs.check(compose_run(overrides))
    assert [s for s in range(1, 13) if evals.chosen(evals.every(None, 5), s, 12)] == [5, 10, 12]
    assert [s for s in range(1, 4) if evals.chosen(evals.every(None, None), s, 3)] == [1, 2, 3]
    run = tmp_path / "run"
    assert evals.enqueue(run, 5, 1280, "step_00000005") and not evals.enqueue(run, 5, 1280, "step_00000005")
    assert evals.pinned(run, 5) and not evals.pinned(run, 10)
    evals.queue_file(run, 5).unlink()
    evals.write_json(evals.step_dir(run, 5) / "job.json", {"step": 5, "job_id": "7"})
    assert evals.pinned(run, 5) and not evals.enqueue(run, 5, 1280, "step_00000005")  # submitted: not again
    (evals.step_dir(run, 5) / "read").touch()
    assert not evals.pinned(run, 5)
    from train.eval_job import record_failure  # the batch script's call after the job's own timeout

    record_failure(run, 5, 124)
    assert evaljobs.status_lines(run, {}) == ["eval: step 5 job 7 failed: its time limit"]
    assert evaljobs.in_flight(run) == []
    (run / evals.ROWS).write_text("".join(json.dumps(dict(zip(evals.FIELDS, row))) + "\n" for row in (
        (5, 640, "val", "loss", 3.5, None, "7", 9.0), (10, 1280, "val", "loss", 3.25, None, "8", 9.0),
        (10, 1280, "sto_words", "acc", 0.75, 0.1, "8", 9.0))) + '{"step": 15, "tok')  # a torn last line
    assert report.scores(run) == {"eval_step": 10, "eval_scores": "sto_words/acc=0.75; val/loss=3.25"}
    trainer = tmp_path / "out" / "checkpoint-40"  # a user's Trainer checkpoint: whole, or sharded state only
    (trainer / "pytorch_model_fsdp_0").mkdir(parents=True)
    (trainer / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="only sharded training state .pytorch_model_fsdp_0."):
        launcher_eval.hf_step(trainer)
    (trainer / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no tokenizer_config.json there"):
        launcher_eval.hf_step(trainer)
    (trainer / "tokenizer_config.json").write_text("{}")
    assert launcher_eval.hf_step(trainer) == 40
    cfg = compose_run(["+cluster=localslurm", f"eval.tasks=[{task}]", "eval.max_pending=1"])
    # the cap waits on an earlier evaluation still queued; one gone without a result is no dependency
    submitted = []
    monkeypatch.setattr(evaljobs.query, "sbatch", lambda path, env: submitted.append(path) or str(20 + len(submitted)))
    monkeypatch.setattr(evaljobs.query, "squeue", lambda ids, env: {"8": "RUNNING"} if "8" in ids else {})
    evals.write_json(evals.step_dir(run, 10) / "job.json", {"step": 10, "job_id": "8"})
    assert evaljobs.submit_step(cfg, run, 15, 0, "python", {}) == "21"
    assert "#SBATCH --dependency=afterany:8\n" in (run / "slurm" / "eval-step_00000015.sbatch").read_text()
    monkeypatch.setattr(evaljobs.query, "squeue", lambda ids, env: {})  # job 8 and 21 gone without a result
    evaljobs.submit_step(cfg, run, 20, 0, "python", {})
    assert "--dependency" not in (run / "slurm" / "eval-step_00000020.sbatch").read_text()
    monkeypatch.setattr(evaljobs.query, "sacct", lambda ids, env: {"8": {"State": "NODE_FAIL"},
                                                                   "21": {"State": "RUNNING"}})
    assert "step 10 job 8 NODE_FAIL, ended without a result, step 15 job 21 RUNNING" in "\n".join(
        evaljobs.status_lines(run, {}))
    text = evaljobs.script(cfg, tmp_path / "run dir", 10, "python", after="7")
    assert "#SBATCH --dependency=afterany:7\n" in text and "#SBATCH --gpus-per-node" not in text
    assert f"python -m train.eval_job '{tmp_path}/run dir' 10" in text and "HF_DATASETS_OFFLINE=1" in text


@pytest.mark.slow
def test_a_lora_runs_checkpoint_is_evaluated_merged_into_its_base(tmp_path):
    """train.eval_job on a local LoRA run's checkpoint (no Slurm: the job's own work): the
    adapters merged into the Hugging Face base, the validation loss the trainer's (merging
    rounds: 1e-5), lm-eval's task scored, the claim taken once, W&B's offline run of the
    evaluation holding the scores against the run's step; then a whole Hugging Face
    directory (a Trainer's checkpoint-N, ``--hf``) scored as step N."""
    import os

    from conftest import launcher, run_dir_of
    from test_hf import _save_hf
    from test_prepare import DOCS, prepare

    with open(tmp_path / "docs.jsonl", "w") as f:
        f.write("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS * 2))
    data = tmp_path / "data"
    assert prepare(str(tmp_path / "docs.jsonl"), "--train-tokenizer", "300", "--out", str(data),
                   cwd=tmp_path).returncode == 0
    base = _save_hf(tmp_path / "base", seed=4, num_key_value_heads=2, vocab_size=320)
    (base / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes())
    task = write_task(tmp_path / "task")
    proc = launcher(["+peft=lora", f"model.hf_path={base}", "data.source=tokens", f"data.path={data}",
                     "train.steps=4", "train.seq_len=32", "train.micro_batch_size=4", "train.eval_every=4",
                     "checkpoint.every_steps=2", f"eval.tasks=[{task}]", "eval.limit=6",
                     "tracking.wandb.project=sto-tests"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1"}
    for job in ("5", "6"):  # job 6 finds step 4 claimed by job 5
        done = subprocess.run([sys.executable, "-m", "train.eval_job", str(run_dir), "4"],
                              env={**env, "SLURM_JOB_ID": job}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "evaluated by another job already" in done.stderr
    rows = {(r["task"], r["metric"]): r for r in evals.rows(run_dir)}
    assert sorted(rows) == [("sto_words", "acc"), ("val", "loss")] and rows["val", "loss"]["job_id"] == "5"
    trainer = next(r["val_loss"] for r in read_metrics(run_dir) if r["step"] == 4)
    assert abs(rows["val", "loss"]["value"] - trainer) <= 1e-5, (rows, trainer)
    assert evals.read_json(evals.step_dir(run_dir, 4) / "result.json")["outcome"] == "ok"
    assert not (evals.step_dir(run_dir, 4) / "hf").exists()  # the export goes once evaluated
    trainer_dir = tmp_path / "out" / "checkpoint-40"  # a user's Trainer checkpoint: a whole HF model
    shutil.copytree(base, trainer_dir)
    from train.hf_io import tokenizer_config  # as a Trainer saves its tokenizer: the EOS named

    tokenizer_config(trainer_dir, json.loads((data / "manifest.json").read_text())["eos_id"], None)
    done = subprocess.run([sys.executable, "-m", "train.eval_job", str(run_dir), "40", "--hf", str(trainer_dir)],
                          env={**env, "SLURM_JOB_ID": "7"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["task"], r["metric"]) for r in evals.rows(run_dir) if r["step"] == 40] == [("sto_words", "acc")]
    from test_tracking import wandb_records

    from train.tracking import run_id

    [offline] = [r for f in run_dir.glob("wandb/offline-run-*/run-*.wandb") for r in [wandb_records(f)]
                 if {x.run.run_id for x in r if x.WhichOneof("record_type") == "run"} == {f"{run_id(run_dir)}-eval-4"}]
    logged = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for x in offline
              if x.WhichOneof("record_type") == "history" for i in x.history.item}
    assert logged["train_step"] == 4 and logged["eval/val/loss"] == rows["val", "loss"]["value"], logged


@pytest.mark.slurm
@pytest.mark.slow
def test_each_checkpoint_is_evaluated_once_across_a_preemption_and_the_chain_follows(tmp_path, slurm_cluster):
    from test_hf import assert_export_has_our_logits
    from test_prepare import DOCS, prepare

    env = slurm_cluster
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.write("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS * 4))
    data = tmp_path / "data"
    assert prepare(str(tmp_path / "docs.jsonl"), "--train-tokenizer", "300", "--out", str(data),
                   cwd=tmp_path).returncode == 0
    task = write_task(tmp_path / "task")
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=2", "data.source=tokens", f"data.path={data}",
                               "model.vocab_size=320", "train.steps=20", "train.seq_len=32", "train.micro_batch_size=4",
                               "train.eval_every=5", "checkpoint.every_steps=5", "checkpoint.keep=1",
                               "fault.step_delay_s=0.4", "eval.on_checkpoint=true", f"eval.tasks=[{task}]",
                               "eval.limit=8", "tracking.tensorboard=true", f"launcher.then=[export,eval,'{CMD}']"], tmp_path, env)
    chain = read_run_json(run_dir)["chain"]
    shown = subprocess.run(["scontrol", "show", "job", "-o", chain[0]["job_id"]], env=env, capture_output=True,
                           text=True).stdout
    assert f"Dependency=afterok:{job}" in shown, shown  # the training still runs (0.4 s a step)
    assert [e["after"] for e in chain] == [job, chain[0]["job_id"], chain[1]["job_id"]], chain
    wait_until(lambda: len(read_metrics(run_dir)) >= 7, 240, "7 steps of the preemptible run")
    hosts = read_run_json(run_dir)["hostnames"]
    subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", "2", "--ntasks-per-node=4",
                    "--output=/dev/null", "--wrap", "sleep 2"], env=env, check=True, capture_output=True, text=True)
    for j in [job] + [e["job_id"] for e in chain]:
        wait_until(lambda: job_gone(j, env), 300, f"job {j} to leave the queue")
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["preemptions"] >= 1, info
    jobs = wait_until(lambda: (lambda s: s if len(s) == 4 and all(e["result"] for e in s) else None)(
        evals.submitted(run_dir)), 180, "4 evaluations to end")
    assert [e["step"] for e in jobs] == [5, 10, 15, 20] and all(e["result"]["outcome"] == "ok" for e in jobs), jobs
    assert [final_states(e["job_id"], env)[-1] for e in jobs] == ["COMPLETED"] * 4
    # kept for their evaluations while pinned (keep=1), pruned by the last one to read its own
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000020"]
    rows = evals.rows(run_dir)
    assert sorted((r["step"], r["task"], r["metric"]) for r in rows) == sorted(
        (s, t, m) for s in (5, 10, 15, 20) for t, m in (("val", "loss"), ("sto_words", "acc")))  # once each
    trainer = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if r.get("val_loss") is not None}
    for r in rows:
        if r["task"] == "val":
            assert abs(r["value"] - trainer[r["step"]]) <= 1e-6, (r, trainer)
        # step 20's: its own job's, or the chain's eval's (whichever claimed the step first)
        assert r["job_id"] in (next(e["job_id"] for e in jobs if e["step"] == r["step"]), chain[1]["job_id"])
        assert r["tokens"] == r["step"] * read_metrics(run_dir)[0]["tokens_per_step"], r
    assert [final_states(e["job_id"], env)[-1] for e in chain] == ["COMPLETED"] * 3
    assert "config.json" in (run_dir / "listing.txt").read_text()  # the command's, after the export
    outputs = [p.read_text() for p in (run_dir / "slurm").glob("*eval-*.out")]
    assert sum("evaluated by another job already" in out for out in outputs) == 1, outputs  # step 20: once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / "eval"))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("eval/val/loss")) == [5, 10, 15, 20]  # the run's step axis
    status = subprocess.run([sys.executable, "-m", "launcher.status", str(run_dir)], cwd=REPO, env=env,
                            capture_output=True, text=True).stdout
    assert "eval: step 20: sto_words/acc " in status and "val/loss" in status, status
    assert_export_has_our_logits(run_dir, run_dir / "export-check", data, 320)
    again = subprocess.run([sys.executable, "-m", "launcher.eval", str(run_dir), "--step", "20", "eval.limit=4"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # a finished run's, again
    assert again.returncode == 0 and "evaluation of step 20: job " in again.stdout, again.stdout + again.stderr
    redo = again.stdout.split("evaluation of step 20: job ")[1].split()[0]
    wait_until(lambda: job_gone(redo, env), 180, f"evaluation job {redo}")
    assert (run_dir / "evals" / "step_00000020.1" / "result.json").is_file()  # the first one's files, aside
    assert sorted(r["task"] for r in evals.rows(run_dir) if r["job_id"] == redo) == ["sto_words", "val"]
