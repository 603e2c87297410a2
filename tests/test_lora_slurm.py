"""LoRA on the real local Slurm cluster: FSDP and DeepSpeed ZeRO-3 on 2 nodes each (one
rank a node, the two jobs side by side), preempted (USR2, Slurm's warning signal) at
step 7 (the step boundary after the signal), requeued and resumed from the adapters-only checkpoint. Each run's losses, the
resumed steps included, equal (1e-5, fp32) those of PEFT's LoRA on the transformers Llama
built from the same base, trained in this process over the same global batches
(tests/test_lora.py's reference): so the resumed run ends where an uninterrupted one
does; after the last of 20 steps every frozen base tensor, gathered, is bit for bit the
base's (peft.verify_base). The ZeRO-3 run's exports (DeepSpeed's files) load in PEFT with
its logits."""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import submit_run, wait_until
from spec.rundir import read_metrics, read_run_json
from test_lora import LORA, assert_exports_load_in_peft, assert_losses_as_peft

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 20


def test_lora_on_two_nodes_preempted_and_resumed_as_peft_trains(tmp_path, slurm_cluster):
    env, runs = slurm_cluster, {}
    for strategy in ("fsdp", "zero3"):
        (tmp_path / strategy).mkdir()
        runs[strategy] = submit_run(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
                                     f"+strategy={strategy}", *LORA, f"train.steps={STEPS}", "peft.verify_base=true",
                                     "fault.step_delay_s=0.4"], tmp_path / strategy, env)
    for strategy, (job, run_dir) in runs.items():
        wait_until(lambda: len(read_metrics(run_dir)) >= 6, 240, f"6 steps of the {strategy} run")
        subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
    for strategy, (job, run_dir) in runs.items():
        wait_until(lambda: read_run_json(run_dir).get("status") in ("completed", "failed", "stopped"), 300,
                   f"the {strategy} run")
        info = read_run_json(run_dir)
        assert (info["status"], info["preemptions"], info["segments"]) == ("completed", 1, 2), (strategy, info)
        # every frozen tensor, gathered after the last step, bit for bit the base's (peft.verify_base)
        assert info["lora_base"] == {"compared": 21, "changed": []}, (strategy, info["lora_base"])
        assert {r["segment"] for r in read_metrics(run_dir)} == {0, 1}
        resumed = re.search(r"resumed from step (\d+)", (run_dir / "logs" / "rank0.log").read_text())
        assert resumed and 7 <= int(resumed[1]) < STEPS, resumed  # the signal's step boundary: 7 unless late
        assert_losses_as_peft(run_dir, tmp_path / strategy, STEPS)
    assert_exports_load_in_peft(runs["zero3"][1], tmp_path / "zero3")
