"""Chat fine-tuning end to end on the real local cluster: the chat SFT of a tiny Qwen2 saved by
``transformers`` (q/k/v biases; embeddings tied, as Qwen2.5's small models are), on chat
data prepared with the Qwen fixture's own template (the loss on the assistant turns only),
across 2 nodes under FSDP and under ZeRO-3. Each run is preempted once by the high
partition, requeued and finished with the per-step losses of the same run uninterrupted
(on the same 2 x 1 layout, bitwise), then exported and loaded by ``transformers``, whose
logits are our model's at the run's last checkpoint."""
from __future__ import annotations

import subprocess

import pytest

from conftest import submit_run, wait_until
from spec.rundir import read_metrics, read_run_json
from test_chat_data import run_prepare
from test_hf import _save_hf, assert_export_has_our_logits

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
transformers = pytest.importorskip("transformers")
STEPS = 10


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory) -> tuple:
    """The Qwen2 checkpoint and the chat data (shared by both strategies)."""
    root = tmp_path_factory.mktemp("sft")
    data, manifest = run_prepare(root, "--max-length", "64")
    assert manifest["splits"]["train"]["loss_tokens"] < manifest["splits"]["train"]["tokens"]  # prompts: no loss
    hf = _save_hf(root / "hf", seed=3, family="Qwen2", vocab_size=352, num_key_value_heads=2,
                  tie_word_embeddings=True)
    return hf, data


def finished(run_dir) -> str:
    return wait_until(lambda: (lambda s: s if s in ("completed", "failed", "stopped") else None)(
        read_run_json(run_dir).get("status")), 400, f"{run_dir.name} to finish")


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_chat_sft_of_a_qwen2_preempted_on_2_nodes_ends_as_if_uninterrupted(tmp_path, slurm_cluster, sft_inputs,
                                                                           strategy):
    env = slurm_cluster
    hf, data = sft_inputs
    args = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", f"+strategy={strategy}",
            f"model.hf_path={hf}", "data.source=chat", f"data.path={data}", f"train.steps={STEPS}",
            "train.seq_len=64", "train.micro_batch_size=2", "checkpoint.save_final=true"]
    _, reference = submit_run(args, tmp_path, env)
    job, run_dir = submit_run(args + ["fault.step_delay_s=0.4"], tmp_path, env)
    wait_until(lambda: len(read_metrics(run_dir)) >= 3, 300, "3 steps of the preemptible run")
    hosts = read_run_json(run_dir)["hostnames"]
    subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", "2", "--ntasks-per-node=4",
                    "--output=/dev/null", "--wrap", "sleep 2"], env=env, check=True, capture_output=True, text=True)
    assert finished(run_dir) == "completed", read_run_json(run_dir)
    assert finished(reference) == "completed", read_run_json(reference)
    info = read_run_json(run_dir)
    assert info["preemptions"] == 1 and info["segments"] == 2 and info["job_id"] == job, info

    final = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    expected = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert sorted(final) == list(range(1, STEPS + 1))
    assert final == expected  # bitwise: the same layout, and no bucket order to move (not DDP)
    assert "resumed from step" in (run_dir / "logs" / "rank0.log").read_text()

    theirs = assert_export_has_our_logits(run_dir, tmp_path / "export", data, 341)
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
