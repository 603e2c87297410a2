"""Float8 training (``strategy.float8``) on this CPU machine, which cannot run it for real:

- the rules of which Linears are converted (spec/float8.py) match the model's Linears,
  and torchao's conversion through train/float8.py converts exactly those;
- the launcher refuses what cannot run in one line (CPU, an A100 profile, DeepSpeed, TP,
  PP, LoRA, fp32, rowwise with the float8 all-gather), and the task refuses a device
  without float8 matmuls at the trainer's start;
- the planner's float8 figures against bf16 (gathered weights, DDP's casts, step time);
- the trainer's FSDP build with float8 at one gloo rank (where FSDP's float8 all-gather
  runs without a collective): it trains near bf16, precomputes the scales after each
  step, and its DCP checkpoint loads into a bf16 model bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

import warm
from conftest import REPO
from helpers import compose_run
from launcher.local import free_port
from spec.config import ConfigError, ModelConfig
from spec.layout import build_layout
from spec.support import check_supported
from spec.validate import validate
from spec import float8 as rules

H100 = ["+cluster=h100x8", "strategy.float8=true"]
FSDP = [*H100, "+strategy=fsdp"]


def _float8(cfg, **fields):
    return dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, float8=True, **fields))


@pytest.mark.parametrize("model", [ModelConfig(), ModelConfig(dim=40, n_heads=4, n_kv_heads=2, vocab_size=100),
                                   ModelConfig(head_dim=32, qkv_bias=True, tie_embeddings=True)])
def test_the_rules_see_the_models_linears_and_torchao_converts_those(model):
    """spec.float8.linears names every Linear of train/model.py with its shape; convert()
    swaps exactly those the rules pass (the head skipped, tied or not; widths not multiples
    of 16 left in bf16) and the report says why each other one stayed."""
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from train import float8
    from train.model import build_model

    cfg = _float8(compose_run(FSDP), float8_skip=["output", "layers.1.feed_forward.w2"])
    cfg = dataclasses.replace(cfg, model=model)
    built = build_model(model, "meta")
    ours = {n: (m.in_features, m.out_features) for n, m in built.named_modules() if isinstance(m, nn.Linear)}
    assert ours == {n: (i, o) for n, i, o in rules.linears(model)}
    report = float8.convert(built, cfg)
    swapped = sorted(n for n, m in built.named_modules() if isinstance(m, Float8Linear))
    converted, skipped = rules.plan(cfg)
    assert swapped == sorted(report.converted) == sorted(converted)
    assert report.skipped == dict(skipped) and "output" in report.skipped
    assert report.skipped["layers.1.feed_forward.w2"].startswith("strategy.float8_skip")
    if model.dim == 40:  # 40 is no multiple of 16: nothing converts, each says so
        assert not converted and set(report.skipped.values()) - {rules.NOT_16} == {"strategy.float8_skip ('output')",
                                                                                  "strategy.float8_skip "
                                                                                  "('layers.1.feed_forward.w2')"}
    blocks, head = rules.converted_params(cfg)
    assert blocks == sum(i * o for n, i, o in rules.linears(model) if n in converted) and head == 0
    assert json.loads(json.dumps(report.as_json()))["converted"] == len(converted)
    tied = rules.skip_reason("output", 64, 256, [], tied=True)
    assert tied == rules.TIED and rules.skip_reason("output", 64, 256, []) is None


@pytest.mark.parametrize("overrides, words", [
    (["+strategy=fsdp", "strategy.float8=true"], "cluster.accelerator=cpu"),
    (["+cluster=a100x8", "+strategy=fsdp", "strategy.float8=true"], "cluster.gpu_capability=8.0"),
    ([*H100, "+strategy=zero2"], "engine=deepspeed"),
    ([*H100, "+strategy=fsdp_tp", "strategy.tensor_parallel=2"], "strategy.tensor_parallel=2"),
    ([*H100, "+strategy=pp", "strategy.pipeline_parallel=2"], "strategy.pipeline_parallel=2"),
    ([*FSDP, "+peft=lora"], "peft.method=lora"),
    ([*FSDP, "strategy.mixed_precision=fp32"], "strategy.mixed_precision=fp32"),
    ([*FSDP, "strategy.float8_recipe=rowwise", "strategy.float8_all_gather=true"], "strategy.float8_all_gather=true"),
    ([*FSDP, "strategy.float8_recipe=blockwise"], "strategy.float8_recipe='blockwise'"),
])
def test_what_cannot_run_is_refused_before_submission(overrides, words):
    """Each in one line naming the field and the value, and a fix (``strategy.float8=false``
    or another value), by the checks the launcher runs (launcher.checks.check)."""
    cfg = compose_run(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
        check_supported(cfg, build_layout(cfg))
    line = str(info.value)
    assert "\n" not in line and words in line and ("set " in line or "use " in line), line


def test_what_runs_passes_and_the_cli_refuses_in_one_line(tmp_path):
    for extra in (["+strategy=fsdp"], ["+strategy=ddp"], ["+strategy=hsdp", "cluster.nodes=2"],
                  ["+strategy=fsdp_grad_op", "strategy.float8_recipe=rowwise"],
                  ["+strategy=fsdp", "strategy.compile=true", "strategy.activation_checkpointing=full"]):
        cfg = compose_run([*H100, *extra])
        validate(cfg)
        check_supported(cfg, build_layout(cfg))
    proc = warm.launcher(["+cluster=a100x8", "+strategy=fsdp", "strategy.float8=true", "launcher.dry_run=true"],
                         cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stdout + proc.stderr
    assert "cluster.gpu_capability=8.0" in proc.stderr and not (tmp_path / "runs").exists()
    ok = warm.launcher([*FSDP, "launcher.dry_run=true"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]


def test_the_task_refuses_a_device_without_float8_at_start(monkeypatch):
    """At the trainer's start: the CPU and a CUDA device below 8.9 are refused in one line
    (run.json failure ``float8_device``, one of the start refusals that end the job);
    capability 9.0 passes, and a run without float8 is never asked."""
    import torch

    from spec.rundir import FLOAT8_DEVICE, START_REFUSALS
    from train.float8 import Float8DeviceError, require_device

    cfg = _float8(compose_run(FSDP))
    with pytest.raises(Float8DeviceError) as info:
        require_device(cfg, torch.device("cpu"), host="n1")
    assert info.value.failure == FLOAT8_DEVICE in START_REFUSALS and "\n" not in str(info.value)
    assert "on n1: the task runs on the CPU" in str(info.value) and "strategy.float8=false" in str(info.value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Float8DeviceError, match=r"NVIDIA A100-SXM4-80GB has compute capability 8\.0, float8 "):
        require_device(cfg, torch.device("cuda", 0), host="n1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    require_device(cfg, torch.device("cuda", 0), host="n1")
    require_device(compose_run(["+strategy=fsdp"]), torch.device("cpu"))


def test_the_planner_counts_float8_against_bf16():
    """Llama 3.1 8B on 8 H100s: under FSDP the gathered blocks shrink by one byte a
    converted parameter (float8 all-gather; rowwise gathers bf16 as before), DDP saves no
    bf16 cast of a converted weight, activations stay; the step's converted matmuls run at
    twice the bf16 rate and FSDP's all-gathers carry 1 byte a converted weight."""
    from launcher.plan.costmodel import candidates, step_time
    from launcher.plan.float8 import FLOAT8_SPEEDUP
    from launcher.plan.memory import estimate

    base = compose_run(["+cluster=h100x8", "+model=llama3_8b", "+strategy=fsdp", "train.seq_len=4096",
                        "train.micro_batch_size=1"])
    f8 = _float8(base)
    layout = build_layout(base)
    blocks, head = rules.converted_params(f8)
    per_block = blocks / base.model.n_layers
    # wq, wo (4096 x 4096), wk, wv (4096 x 1024), w1, w2, w3 (4096 x 14336); the head skipped
    assert head == 0 and per_block == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    bf, fl = estimate(base, layout), estimate(f8, layout)
    assert bf.buffer_bytes - fl.buffer_bytes == pytest.approx(2 * per_block)  # (e - 1) x (2 blocks)
    assert fl.activation_bytes == bf.activation_bytes and fl.param_bytes == bf.param_bytes
    rowwise = estimate(_float8(base, float8_recipe="rowwise"), layout)
    assert rowwise.buffer_bytes == bf.buffer_bytes
    ddp = dataclasses.replace(base, strategy=dataclasses.replace(base.strategy, data_parallel="ddp", dp_shard=1,
                                                                 dp_replicate=-1, name="ddp"))
    assert estimate(ddp, layout).buffer_bytes - estimate(_float8(ddp), layout).buffer_bytes == pytest.approx(2 * blocks)
    t_bf, t_fl = step_time(base, layout), step_time(f8, layout)
    saved = 6.0 * blocks * 4096 * (1 - 1 / FLOAT8_SPEEDUP) / (989e12 * 0.4)
    assert t_bf.compute_s - t_fl.compute_s == pytest.approx(saved)
    assert t_fl.dp_comm_s < t_bf.dp_comm_s and 1.3 < t_bf.step_s / t_fl.step_s < FLOAT8_SPEEDUP
    ranked = candidates(f8)
    assert ranked and all(k.cfg.strategy.float8 and k.cfg.strategy.engine == "torch" and k.layout.tp == 1
                          and k.layout.pp == 1 for k in ranked)
    assert "strategy.float8=true" in ranked[0].overrides()


def fsdp_float8_steps(rank: int, port: int, cfg, out: str) -> None:
    """The trainer's build (train.parallelize) of ``cfg`` at one gloo rank, three steps,
    then its DCP checkpoint read back into the same model built without float8."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed.checkpoint as dcp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from train.harness.dist import init_distributed, shutdown
    from train.model import build_model
    from train.parallelize import parallelize

    ctx = init_distributed(120)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    result = {}
    for name, run in (("bf16", dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, float8=False))),
                      ("float8", cfg)):
        engine = parallelize(build_model(run.model, "meta"), run, build_layout(run), ctx)
        losses = [float(engine.train_step([(batch[:, :-1], batch[:, 1:])], 1e-3)[0]) for _ in range(3)]
        result[name] = losses
        if name == "float8":
            wq = engine.module.layers["0"].attention.wq.weight
            result["report"] = engine.float8.as_json()
            result["subclass"] = type(wq.to_local()).__name__
            result["scale"] = wq._local_tensor._precomputed_scale is not None  # set by the post-step hook
            dcp.save(engine.state_dict(), checkpoint_id=f"{out}/ckpt")
            bf16 = parallelize(build_model(run.model, "meta"),
                               dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, float8=False)),
                               build_layout(cfg), ctx)
            state = bf16.state_dict()
            dcp.load(state, checkpoint_id=f"{out}/ckpt")
            bf16.load_state_dict(state)
            ours = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
            theirs = {k: v.full_tensor() for k, v in bf16.module.state_dict().items()}
            result["same"] = ours.keys() == theirs.keys() and all(
                torch.equal(ours[k].float(), theirs[k].float()) for k in ours)
            result["is_subclass"] = isinstance(wq.to_local(), WeightWithDynamicFloat8CastTensor)
    Path(out, "out.json").write_text(json.dumps(result))
    shutdown()


def test_fsdp_float8_trains_near_bf16_and_its_checkpoint_loads_in_bf16(tmp_path):
    cfg = _float8(compose_run(["+strategy=fsdp", "cluster.gpus_per_node=1", "train.seq_len=16"]),
                  mixed_precision="bf16")
    proc = warm.call_ranks(fsdp_float8_steps, 1, (free_port(), cfg, str(tmp_path)), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["report"] == {"recipe": "tensorwise", "all_gather": True, "converted": 14,
                             "skipped": {"output": "strategy.float8_skip ('output')"}}
    assert out["subclass"] == "WeightWithDynamicFloat8CastTensor" and out["is_subclass"] and out["scale"]
    for bf, f8 in zip(out["bf16"], out["float8"]):
        assert abs(f8 - bf) / bf < 0.02, (out["bf16"], out["float8"])
    assert out["float8"][-1] < out["float8"][0] and out["same"]


def test_docs_say_what_is_built():
    text = (REPO / "docs/strategies.md").read_text()
    section = text[text.index("## Float8"):]
    for words in ("strategy.float8_recipe", "strategy.float8_skip", "strategy.float8_all_gather", "8.9",
                  "not run on a GPU"):
        assert words in section, words


def test_the_gpu_check_rows_judge_float8_against_bf16(tmp_path):
    """bench/gpu_check_float8.py on made-up runs: within 2% at every step passes and the
    report gives both tokens/s, their ratio and peaks; 3% at one step fails the row."""
    import subprocess
    import sys

    sys.path.insert(0, str(REPO))
    from bench.gpu_check_float8 import against, report
    from bench.gpu_check_runner import Row

    def run(name, tokens_per_s, losses, float8=None):
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"backend": "nccl", **({"float8": float8} if float8 else {})}))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": loss, "tokens_per_s": tokens_per_s,
                                                             "peak_mem_bytes": 2**33}) + "\n"
                                                 for s, loss in enumerate(losses, 1)))
        return d

    ref = run("bf16", 1000.0, [10.0 - 0.1 * s for s in range(10)])
    ok = run("f8", 1300.0, [10.01 - 0.1 * s for s in range(10)], {"recipe": "tensorwise", "all_gather": True,
                                                                   "converted": 7, "skipped": {}})
    bad = run("f8bad", 1300.0, [10.0 - 0.1 * s for s in range(9)] + [9.1 * 1.03], {"converted": 7})
    done = subprocess.CompletedProcess([], 0)
    assert against(ref)(Row("float8/x", [], None, run_dir=ok), done) == ""
    assert "1.300x" in report(ref)(Row("float8/x", [], None, run_dir=ok)) and "8.0 vs 8.0 GiB" in \
        report(ref)(Row("float8/x", [], None, run_dir=ok))
    assert "worst relative loss difference 0.03" in against(ref)(Row("float8/x", [], None, run_dir=bad), done)
