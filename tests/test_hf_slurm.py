"""Hugging Face weights in and out, end to end on the real local cluster: a tiny Llama saved by ``transformers``
is imported, fine-tuned with FSDP across 2 nodes on text prepared with a tokenizer,
preempted once by the high partition, requeued and finished; its validation loss
falls; TensorBoard's log (read back with TensorBoard's reader) and W&B's offline run
hold every step once across the two segments under the run's id; the export loads in
``transformers`` with the logits of our model at the run's last checkpoint."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from conftest import submit_run, wait_until
from spec.rundir import read_metrics, read_run_json
from test_hf import _save_hf, assert_export_has_our_logits
from test_prepare import DOCS, prepare
from test_tracking import wandb_segments

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


def test_hugging_face_model_fine_tuned_on_text_across_a_preemption(tmp_path, slurm_cluster):
    env = slurm_cluster
    from train.tracking import run_id

    with open(tmp_path / "docs.jsonl", "w") as f:
        for doc in DOCS * 4:
            f.write(json.dumps({"text": doc}) + "\n")
    data = tmp_path / "data"
    prep = prepare(str(tmp_path / "docs.jsonl"), "--train-tokenizer", "300", "--out", str(data), cwd=tmp_path)
    assert prep.returncode == 0, prep.stderr
    hf = _save_hf(tmp_path / "hf", seed=4, num_key_value_heads=2, vocab_size=320)
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "+strategy=fsdp",
                               f"model.hf_path={hf}", "data.source=tokens", f"data.path={data}", "train.steps=16",
                               "train.seq_len=32", "train.micro_batch_size=4", "train.eval_every=4",
                               "fault.step_delay_s=0.4", "checkpoint.save_final=true", "tracking.tensorboard=true",
                               "tracking.wandb.project=sto-tests"], tmp_path, env)
    wait_until(lambda: len(read_metrics(run_dir)) >= 4, 240, "4 steps of the preemptible run")
    hosts = read_run_json(run_dir)["hostnames"]
    subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", "2", "--ntasks-per-node=4",
                    "--output=/dev/null", "--wrap", "sleep 2"], env=env, check=True, capture_output=True, text=True)
    wait_until(lambda: read_run_json(run_dir).get("status") in ("completed", "failed", "stopped"), 400, "the run")
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["preemptions"] >= 1 and info["segments"] >= 2, info
    assert info["job_id"] == job

    rows = read_metrics(run_dir)
    final = {r["step"]: r for r in rows}
    assert sorted(final) == list(range(1, 17))
    vals = [final[s]["val_loss"] for s in (4, 8, 12, 16)]
    assert vals[-1] < vals[0], vals

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 17))
    assert all(math.isclose(e.value, final[e.step]["loss"], rel_tol=1e-6) for e in events.Scalars("train/loss"))
    assert [e.step for e in events.Scalars("val/loss")] == [4, 8, 12, 16]
    segments = wandb_segments(run_dir)
    assert len(segments) >= 2 and all(ids == {run_id(run_dir)} for ids, _ in segments), segments
    logged = [step for _, steps in segments for step in steps]
    assert logged == list(range(1, 17)), segments  # each step once, in order, across the segments

    assert_export_has_our_logits(run_dir, tmp_path / "export", data, 300)
