"""The planner: parameter counts, memory formulas, cost model, CLI contract and errors."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from warm import pythonpath
from helpers import compose_run
from launcher.plan.costmodel import (all_gather_bytes, all_reduce_bytes, bubble_fraction, candidates, link_gbps,
                                step_time)
from launcher.plan.memory import (DS_SUB_GROUP, GB, OP_SAC, activation_bytes, activation_terms, block_bytes, estimate,
                                  op_sac_block_bytes, stage_params, zero_paper_bytes)
from launcher.overrides import group_options
from launcher.plan.cli import check_fits
from spec.config import ConfigError, ModelConfig
from spec.layout import build_layout
from spec.model_size import count_params, ffn_hidden_dim, flops_per_token, param_breakdown

LONG = ["train.seq_len=8192", "train.micro_batch_size=1"]
CONTRACT = ("strategy", "params", "dp_degree", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
            "total_bytes", "gpu_bytes", "fits")


def plan_cli(args, timeout=120):
    """``python -m launcher.plan ARGS``, forked from the warm server (tests/warm.py: ~1.3 CPU-s
    of imports a call saved; its cold start without torch is tests/test_login_side.py's)."""
    import warm

    return warm.run_module("launcher.plan", list(args), cwd=REPO, timeout=timeout)


@pytest.mark.parametrize("name", group_options("model"))
def test_param_count_equals_built_model(name):
    from train.model import build_model

    cfg = compose_run([f"+model={name}"]).model
    model = build_model(cfg, "meta")
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    b = param_breakdown(cfg)
    assert b.layer == sum(p.numel() for p in model.layers["0"].parameters())
    assert b.embedding == model.tok_embeddings.weight.numel()


def test_zero_paper_arithmetic_7_5b_on_64_gpus():
    """Fig. 1 of the ZeRO paper: 7.5B parameters, 64 GPUs, K=12."""
    totals = [round(sum(zero_paper_bytes(7.5e9, stage, 64)) / GB, 1) for stage in range(4)]
    assert totals == [120.0, 31.4, 16.6, 1.9]


def _bytes_per_param(overrides, model="llama3_8b"):
    cfg = compose_run(["+cluster=a100x8", f"+model={model}", *overrides])
    mem = estimate(cfg, build_layout(cfg))
    return mem.model_state_bytes / mem.stage_params, mem


@pytest.mark.parametrize("strategy,precision,expected", [
    ("ddp", "fp32", 16.0), ("ddp", "bf16", 16.0),
    ("fsdp", "bf16", 16 / 8), ("hsdp", "fp32", 16 / 8),
    # DeepSpeed at its step: module params, the gradient partition and its fp32 copy, the
    # fp32 master partition and Adam (the paper: stage 1 = 4 + 12/8, stage 2 = 2 + 14/8)
    ("zero1", "fp32", 4 + 20 / 8), ("zero2", "fp32", 4 + 20 / 8),
    ("zero1", "bf16", 2 + 18 / 8), ("zero2", "bf16", 2 + 18 / 8),
    # ZeRO-3 below one sub-group per rank (1B / 8 < sub_group_size): the whole fp32 copy
    ("zero3", "fp32", 24 / 8), ("zero3", "bf16", 20 / 8),
])
def test_model_state_bytes_per_param(strategy, precision, expected):
    model = "llama3_1b" if strategy == "zero3" else "llama3_8b"
    per_param, _ = _bytes_per_param([f"+strategy={strategy}", f"strategy.mixed_precision={precision}"], model)
    assert per_param == pytest.approx(expected)


@pytest.mark.parametrize("precision,e", [("fp32", 4), ("bf16", 2)])
def test_zero1_holds_full_gradients_with_accumulation(precision, e):
    """DeepSpeed stage 1 reduces only at the accumulation boundary (measured: 47.2 MB vs
    46.9 predicted, bench/planner.py, 4 ranks, grad_accum 2); stage 2 reduces every micro-step."""
    accum = ["train.grad_accum=2", f"strategy.mixed_precision={precision}"]
    assert _bytes_per_param(["+strategy=zero1", *accum])[0] == pytest.approx(e + e + 12 / 8)
    assert _bytes_per_param(["+strategy=zero2", *accum])[0] == pytest.approx(e + (e + 16) / 8)


def test_zero3_upcasts_one_sub_group_at_a_time():
    _, mem = _bytes_per_param(["+strategy=zero3", "strategy.mixed_precision=bf16"], "llama3_70b")
    psi = mem.stage_params
    assert psi / 8 > DS_SUB_GROUP  # 70B on 8 GPUs: several sub-groups per rank
    assert mem.grad_bytes == pytest.approx(2 * psi / 8 + 4 * DS_SUB_GROUP)
    assert mem.param_bytes + mem.optimizer_bytes == pytest.approx((2 + 12) * psi / 8)


def test_offload_moves_states_to_host():
    _, mem = _bytes_per_param(["+strategy=zero3_offload", "strategy.mixed_precision=bf16"])
    psi = mem.stage_params
    assert mem.model_state_bytes == 0  # the gradient partition buffer is on the host too (stage3.py)
    # bf16 params and gradient partition, master + Adam, fp32 grads
    assert mem.cpu_bytes == pytest.approx((2 + 2 + 12 + 4) * psi / 8)
    assert mem.buffer_bytes < 2.5e9  # gathered modules and buckets (was 4 GB with the gradients)


def test_tensor_and_pipeline_parallel_divide_params():
    m = compose_run(["+model=llama3_8b"]).model
    b = param_breakdown(m)
    psi, block, root = stage_params(m, 8, 1)
    assert psi == m.n_layers * (b.layer_matrices // 8 + b.layer_norms) + b.embedding // 8 + b.final_norm + b.head // 8
    assert block == b.layer_matrices // 8 + b.layer_norms and root == (b.embedding + b.head) // 8 + b.final_norm
    psi2, _, _ = stage_params(m, 1, 2)
    assert psi2 == 16 * b.layer + b.head + b.final_norm  # the last stage: half the blocks and the head


def test_activation_formula_on_fixed_inputs():
    m = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256)
    f = ffn_hidden_dim(m)
    assert f == 192
    assert block_bytes(m, 1, 4, False, False) == 24 * 64 + 4 * (2 * 64 + 2 * 64 + 4 * f)
    assert block_bytes(m, 1, 2, True, False) == 26 * 64 + 2 * (2 * 64 + 2 * 64 + 4 * f)  # autocast casts
    assert block_bytes(m, 2, 2, False, True) == 2 * 64 / 2
    base = ["+cluster=local", "model.dim=64", "train.micro_batch_size=4", "train.seq_len=32"]
    cfg = compose_run(base)
    mem = estimate(cfg, build_layout(cfg))
    full = block_bytes(m, 1, 4, False, False)
    assert mem.activation_bytes == 4 * 32 * (2 * full + full + 12 * 64 + 12 * 256)
    acts, kept = mem.activations_by_mode, block_bytes(m, 1, 4, False, True)
    assert acts["selective"] == 4 * 32 * (kept + full + full + 12 * 64 + 12 * 256)  # block 0 checkpointed
    assert acts["full"] == 4 * 32 * (2 * kept + 2 * full + 12 * 64 + 12 * 256)     # last one recomputed
    deep = compose_run(base + ["model.n_layers=8"])
    acts = estimate(deep, build_layout(deep)).activations_by_mode
    assert acts["none"] > acts["selective"] > acts["full"]
    double = compose_run(base + ["train.micro_batch_size=8"])
    assert estimate(double, build_layout(double)).activation_bytes == 2 * mem.activation_bytes
    accum = compose_run(base + ["train.grad_accum=4"])
    assert estimate(accum, build_layout(accum)).total_bytes == mem.total_bytes


def test_vocab_parallel_loss_shards_the_logits():
    """TP keeps the logits sharded over the vocabulary (train/parallelize.py): the head's
    (e + 4) vocab and the 4 vocab gradient per token divide by tp, on a pipeline's last
    stage too."""
    base = ["+cluster=h100x8", "+model=llama3_8b", "+strategy=fsdp_tp", "train.micro_batch_size=1",
            "train.seq_len=1024", "strategy.mixed_precision=bf16"]
    acts = {}
    for tp in (2, 4):
        cfg = compose_run([*base, f"strategy.tensor_parallel={tp}"])
        acts[tp] = estimate(cfg, build_layout(cfg)).activation_bytes
    m = compose_run(base).model
    blocks = {tp: 1024 * (m.n_layers + 1) * block_bytes(m, tp, 2, False, False) for tp in (2, 4)}
    head = {tp: 1024 * (10 * m.dim / tp + 2 * m.dim + 10 * m.vocab_size / tp) for tp in (2, 4)}
    assert acts[2] == pytest.approx(blocks[2] + head[2]) and acts[4] == pytest.approx(blocks[4] + head[4])
    pp = compose_run(["+cluster=h100x8", "+model=llama3_8b", "+strategy=pp_fsdp_tp", "train.seq_len=1024",
                      "strategy.mixed_precision=bf16"])
    layout = build_layout(pp)
    assert layout.pp > 1 and layout.tp > 1
    assert activation_terms(pp, layout, "none")[3] == 4.0 * pp.model.vocab_size / layout.tp  # sharded there too


def test_op_level_selective_checkpointing():
    """torchtitan's op-level policy keeps every other matmul's output and attention's: the
    block input h, wq h, wv kv, attention h, w1 f, w2 h."""
    m = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256)
    assert op_sac_block_bytes(m, 1, 2) == 2 * (4 * 64 + 32 + ffn_hidden_dim(m))
    assert op_sac_block_bytes(m, 4, 2) == op_sac_block_bytes(m, 1, 2) / 4
    cfg = compose_run(["+cluster=h100x8", "+model=llama3_8b", "+strategy=fsdp", *LONG])
    layout = build_layout(cfg)
    modes = {mode: activation_bytes(cfg, layout, mode) for mode in ("none", "selective", OP_SAC, "full")}
    assert modes["none"] > modes["selective"] > modes[OP_SAC] > modes["full"]
    assert estimate(cfg, layout, OP_SAC).activation_bytes == modes[OP_SAC]


def test_collective_volumes_and_bubble():
    assert all_reduce_bytes(8, 1e9) == pytest.approx(1.75e9)
    assert all_gather_bytes(4, 1e9) == pytest.approx(0.75e9)
    assert all_reduce_bytes(1, 1e9) == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(4, 12, chunks=2) == pytest.approx(3 / 27)


def test_link_bandwidth_inside_and_across_nodes():
    cfg = compose_run(["+cluster=h100x8", "cluster.nodes=4"])
    layout = build_layout(cfg)
    assert link_gbps(cfg, layout, 8, 1) == 450          # one node: NVLink
    assert link_gbps(cfg, layout, 32, 1) == 8 * 50      # 8 NICs per node carry the ring
    assert link_gbps(cfg, layout, 4, 8) == 50           # one member per node: one NIC
    assert link_gbps(cfg, layout, 16, 2) == 4 * 50


def test_flops_per_token_count_the_heads_matmul_tied_or_not():
    """PaLM's 6N + attention, N the matmuls' parameters: every one but the input embedding's
    lookup. A tied head still multiplies by its (shared) matrix. Llama 3.2 1B at seq 2048:
    torchtitan's count for the same shape (it does not tie) is 8.2202 GFLOP a token."""
    tied = compose_run(["+model=llama3_1b"]).model
    assert tied.tie_embeddings
    untied = dataclasses.replace(tied, tie_embeddings=False)
    attention = 12.0 * 16 * 32 * 64 * 2048
    assert flops_per_token(tied, 2048) == flops_per_token(untied, 2048) == \
        6.0 * (count_params(untied) - 128256 * 2048) + attention
    assert flops_per_token(tied, 2048) == pytest.approx(8.2202e9, rel=1e-4)


def test_step_time_on_fixed_inputs():
    cfg = compose_run(["+cluster=h100x8", "+model=llama3_8b", "+strategy=fsdp", *LONG])
    layout = build_layout(cfg)
    t = step_time(cfg, layout, mfu=0.5)
    compute = flops_per_token(cfg.model, 8192) * 8192 / (989e12 * 0.5)
    assert t.compute_s == pytest.approx(compute)
    psi = count_params(cfg.model)
    # two bf16 all-gathers and an fp32 reduce-scatter over 8 ranks, on NVLink
    assert t.dp_comm_s == pytest.approx((2 * 2 * psi + 4 * psi) * 7 / 8 / 450e9)
    assert t.step_s == pytest.approx(compute) and t.exposed_dp_s == 0.0
    assert t.tokens_per_step == 8 * 8192 and t.mfu == pytest.approx(0.5)

    pp = compose_run(["+cluster=h100x8", "+model=llama3_8b", "+strategy=ddp", "strategy.pipeline_parallel=4",
                      "strategy.pp_microbatches=8", "train.micro_batch_size=8", "train.seq_len=8192"])
    tp = step_time(pp, build_layout(pp))
    assert tp.bubble_s == pytest.approx(tp.compute_s * 3 / 8)


def test_recommendation_follows_decision_tree_at_the_ends():
    small = candidates(compose_run(["+cluster=h100x8", "+model=llama3_8b", "train.seq_len=4096",
                                    "train.micro_batch_size=1"]))
    assert small[0].layout.tp == 1 and small[0].layout.pp == 1 and small[0].memory.shard_degree == 8
    big = candidates(compose_run(["+cluster=h100x8", "+model=llama3_405b", "cluster.nodes=16", *LONG]))
    assert big and big[0].layout.tp > 1 and big[0].layout.dp > 1
    assert not candidates(compose_run(["+cluster=h100x8", "+model=llama3_405b", *LONG]))  # 1 node: nothing fits


def test_check_fits():
    def fits(cfg):
        check_fits(cfg, build_layout(cfg))

    with pytest.raises(ConfigError) as exc:
        fits(compose_run(["+cluster=a100x8", "+model=llama3_70b"]))
    line = str(exc.value)
    assert "\n" not in line and "cluster.gpu_mem_gb=80" in line and "launcher.allow_oom=true" in line
    fits(compose_run(["+cluster=local", "+model=llama3_70b"]))  # no gpu_mem_gb: no check
    fits(compose_run(["+cluster=a100x8"]))                       # tiny fits
    cfg = compose_run(["+cluster=a100x8", "+model=llama3_70b"])
    cfg.launcher = dataclasses.replace(cfg.launcher)
    object.__setattr__(cfg.launcher, "allow_oom", True)
    fits(cfg)


def test_json_contract_for_every_preset():
    proc = plan_cli(["+cluster=a100x8", "+model=llama3_8b", "plan.format=json"])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["strategy"] for r in rows} == set(group_options("strategy"))
    for row in rows:
        assert all(key in row for key in CONTRACT), row
        assert isinstance(row["fits"], bool) and row["gpu_bytes"] == 80e9 and row["params"] == 8030261248
        parts = sum(row[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
        assert row["total_bytes"] >= parts


def test_json_for_one_strategy_and_recommendations():
    proc = plan_cli(["+cluster=a100x8", "+model=llama3_8b", "+strategy=zero3", "plan.format=json"])
    rows = json.loads(proc.stdout)
    assert [r["strategy"] for r in rows] == ["zero3"] and rows[0]["dp_degree"] == 8
    proc = plan_cli(["+cluster=h100x8", "+model=llama3_8b", "plan.format=json", "plan.recommend=true", "plan.top=2"])
    rows = json.loads(proc.stdout)
    assert len(rows) == 2 and all(r["fits"] and r["step_s"] > 0 and "overrides" in r for r in rows)


def test_table_output():
    proc = plan_cli(["+cluster=h100x8", "+model=llama3_8b", *LONG])
    assert proc.returncode == 0, proc.stderr
    assert "llama3_8b (8,030.3 M params) on h100x8" in proc.stdout
    assert "best layouts for 1 x h100x8" in proc.stdout and "#1: python -m launcher" in proc.stdout


@pytest.mark.parametrize("args,expect", [
    (["+cluster=nope"], "unknown cluster 'nope'"),
    (["cluster=a100x8"], "append it with +cluster=a100x8"),
    (["plan.format=xml"], "plan.format must be one of table, json"),
    (["plan.bogus=1"], "unknown planner option"),
    (["plan.top=abc"], "plan.top must be a int"),
    (["train.foo=1"], "unknown field 'train.foo'"),
    (["+cluster=a100x8", "cluster.nodes=1,2"], "add -m"),
    (["+cluster=a100x8", "cluster.nodes=abc"], "cluster.nodes takes an integer, not 'abc'"),
    (["+cluster=a100x8", "train.seq_len=8192"], "exceeds model.max_seq_len=256"),
    (["+cluster=a100x8", "+strategy=ddp", "strategy.tensor_parallel=16"], "TP must stay inside one node"),
])
def test_bad_input_is_one_line_exit_2(args, expect):
    proc = plan_cli(args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], proc.stderr


def test_planner_imports_no_torch():
    code = "import sys, launcher.plan.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_predicted_states_and_activations_match_ranks_on_cpu(tmp_path):
    """2 gloo ranks: model states at the optimizer step and the tensors autograd saves
    within 10% of the prediction (bench/planner.py measures; all presets: run it).
    Model states at 2 and 4 ranks for DDP / ZeRO-1/2/3 / FSDP against the planner:
    tests/test_memory.py, on the same measurement. The bench's own ranks, forked warm
    (tests/warm.py) instead of spawned: its peak RSS is not checked here."""
    import warm
    from bench import planner
    from launcher.local import free_port
    from launcher.plan.cli import compose
    from launcher.plan.memory import estimate
    from spec.layout import build_layout

    for name in ("fsdp", "zero3"):
        cfg = compose(["+cluster=local", "cluster.gpus_per_node=2", f"+strategy={name}",
                       "strategy.mixed_precision=fp32", *planner.MODEL])
        layout = build_layout(cfg)
        out = tmp_path / name
        out.mkdir()
        proc = warm.call_ranks(planner.rank_main, 2, (2, free_port(), cfg, str(out)), cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
        row = planner.row_of(name, 2, "fp32", cfg, layout, estimate(cfg, layout), ranks, seconds=0.0)
        assert abs(row["state_ratio"] - 1) < 0.10, row
        assert abs(row["activation_ratio"] - 1) < 0.10, row


def test_plan_help_prints_its_options_and_groups():
    proc = plan_cli(["--help"])
    assert proc.returncode == 0, proc.stderr
    assert "plan.format=table|json" in proc.stdout and "strategy=ddp," in proc.stdout and "zero3" in proc.stdout


@pytest.mark.parametrize("overrides", [
    ["+model=llama3_70b", "cluster.nodes=2", *LONG],
    ["+model=llama3_70b", "cluster.nodes=4", *LONG],
    ["+model=llama3_8b", "train.seq_len=2048", "train.micro_batch_size=2"],
])
def test_ranking_holds_only_runnable_fitting_layouts_by_exact_step_time(overrides):
    """Every recommended layout passes the launcher's checks and fits; the order is the
    predicted step time itself (then memory), so MFU never rises down the list."""
    from launcher.checks import check

    cands = candidates(compose_run(["+cluster=h100x8", *overrides]))
    assert cands
    for k in cands:
        assert k.memory.fits and k.memory.host_fits
        dry = dataclasses.replace(k.cfg, launcher=dataclasses.replace(k.cfg.launcher, dry_run=True),
                                  cluster=dataclasses.replace(k.cfg.cluster, signal_delay_s=WINDOW_S))
        check(dry)  # raises ConfigError for anything the launcher would refuse
    keys = [(k.time.step_s, k.memory.total_bytes) for k in cands]
    assert keys == sorted(keys)
    mfus = [k.time.mfu for k in cands]
    assert all(a >= b - 1e-12 for a, b in zip(mfus, mfus[1:]))


# The planner ranks layouts by memory and speed; whether the signal-time save of a big
# model fits cluster.signal_delay_s is the launch's own check, which the shipped profiles'
# filesystem (20 GB/s in all) fails for 70B on 2 nodes at the default 120 s
# (tests/test_checkpoint_plan.py): these tests give the save its time.
WINDOW_S = 900
WINDOW = f"cluster.signal_delay_s={WINDOW_S}"


def _suggestions(message):
    """The fixes an OOM refusal names: ``use A or B, or launcher.allow_oom=true ...``."""
    fixes = message.split("; use ", 1)[1].rsplit(", or launcher.allow_oom=true", 1)[0]
    return [fix.split(" in place of ")[0].split(" (python -m")[0] for fix in fixes.split(" or ")]


@pytest.mark.parametrize("overrides", [
    ["+cluster=a100x8", "+model=llama3_70b", "cluster.nodes=4"],
    ["+cluster=h100x8", "+model=llama3_8b", "+strategy=ddp", *LONG],
    ["+cluster=h100x8", "+model=llama3_70b", "+strategy=zero3", "cluster.nodes=2", *LONG],
    ["+cluster=h100x8", "+model=llama3_8b", "+strategy=fsdp", "train.seq_len=8192", "train.micro_batch_size=4"],
    # nothing fits at this micro-batch on these nodes: a smaller one at the same global batch
    ["+cluster=a100x8", "+model=llama3_70b", "+strategy=zero3", "cluster.nodes=2", "train.seq_len=4096"],
    # nothing fits on one node at any micro-batch: more nodes
    ["+cluster=h100x8", "+model=llama3_405b", "+strategy=fsdp", "train.seq_len=8192"],
])
def test_every_suggestion_of_an_oom_refusal_is_accepted(overrides):
    """Each fix printed with the refusal, applied as it says (a +strategy=... replaces the
    user's strategy overrides, a key it names replaces the user's), passes the launcher's
    own checks."""
    from launcher.checks import check

    with pytest.raises(ConfigError) as exc:
        cfg = compose_run(overrides)
        check_fits(cfg, build_layout(cfg))
    fixes = _suggestions(str(exc.value))
    assert fixes and all(f.strip() for f in fixes), str(exc.value)
    for fix in fixes:
        check(compose_run([*_applied(overrides, fix.split()), "launcher.dry_run=true", WINDOW]))


def _applied(overrides, words):
    """``overrides`` with a printed fix applied: its +strategy=... replaces the user's
    strategy overrides, and each key it sets replaces the user's value of that key."""
    keys = {w.lstrip("+").split("=")[0] for w in words}
    strategy = any(w.startswith("+strategy=") for w in words)
    mine = [o for o in overrides if o.lstrip("+").split("=")[0] not in keys
            and not (strategy and o.lstrip("+").startswith("strategy"))]
    return [*mine, *words]


def test_nearest_runnable_names_the_fewest_nodes_that_run():
    """Nothing on one node: the refusal and the planner name a node count and a layout the
    launcher accepts, and nothing on fewer nodes fits (at any micro-batch)."""
    from launcher.checks import check
    from launcher.plan.costmodel import nearest_runnable

    base = ["+cluster=h100x8", "+model=llama3_405b", "train.seq_len=8192"]
    nearest = nearest_runnable(compose_run(base))
    assert nearest is not None and nearest.cfg.cluster.nodes > 1 and nearest.memory.fits
    for nodes in (1, nearest.cfg.cluster.nodes // 2):
        for mb in (8, 4, 2, 1):
            assert not candidates(compose_run([*base, f"cluster.nodes={nodes}", f"train.micro_batch_size={mb}"]))
    text = plan_cli(base)
    assert text.returncode == 1
    fix = text.stderr.split("the nearest that runs: ")[1].split()
    assert fix[0] == f"cluster.nodes={nearest.cfg.cluster.nodes}"
    check(compose_run([*_applied(base, fix), "launcher.dry_run=true", WINDOW]))
    # nothing anywhere near: the reason says so
    none = plan_cli(["+cluster=a100x8", "+model=llama3_405b", "cluster.gpu_mem_gb=1",
                     "plan.format=json", "plan.recommend=true"])
    assert none.returncode == 1 and "nothing fits up to 16x the nodes" in json.loads(none.stdout)[0]["error"]


def test_nothing_runnable_exits_1_with_the_reason_in_text_and_json():
    args = ["+cluster=h100x8", "+model=llama3_405b", *LONG]
    text = plan_cli(args)
    assert text.returncode == 1, text.stdout + text.stderr
    assert "no layout of llama3_405b on 1 x h100x8" in text.stdout
    assert text.stderr.strip().startswith("error: cluster.nodes=1: no layout") and len(text.stderr.splitlines()) == 1
    js = plan_cli([*args, "plan.format=json", "plan.recommend=true"])
    assert js.returncode == 1 and "no layout of llama3_405b" in js.stderr
    assert json.loads(js.stdout) == [{"error": js.stderr.strip()[len("error: "):]}]
    # the plan of one strategy: the same exit status as its text, the JSON still printed;
    # with no ranking asked (plan.top=0), 0 in both
    rows = plan_cli([*args, "+strategy=fsdp", "plan.format=json"])
    assert rows.returncode == plan_cli([*args, "+strategy=fsdp"]).returncode == 1, rows.stderr
    assert json.loads(rows.stdout)[0]["fits"] is False and "no layout of llama3_405b" in rows.stderr
    assert plan_cli([*args, "+strategy=fsdp", "plan.format=json", "plan.top=0"]).returncode == 0


def test_every_strategy_skipped_is_bad_input():
    proc = plan_cli(["+cluster=h100x8", "cluster.gpus_per_node=6", "cluster.nvlink_domain=4", "plan.format=json"])
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cluster.nvlink_domain=4 must divide cluster.gpus_per_node=6" in lines[0]


def test_offload_needs_host_memory():
    """zero3_offload of 70B on one node offloads 20 x 70.6e9 = 1.41 TB: more than the 1 TB
    assumed when the job's memory is unknown (cluster.mem_gb null) and than a 1200 GB node
    taken whole (mem_gb=0), less than cluster.mem_gb=2000 or h100x8's whole node
    (mem_gb=0, node_mem_gb=2000)."""
    base = ["+cluster=h100x8", "+model=llama3_70b", "+strategy=zero3_offload", "strategy.activation_checkpointing=full",
            "train.seq_len=2048", "train.micro_batch_size=1"]
    cfg = compose_run([*base, "cluster.mem_gb=null"])
    mem = estimate(cfg, build_layout(cfg))
    assert mem.host_per_node == pytest.approx(20 * count_params(cfg.model)) and not mem.host_fits and not mem.fits
    with pytest.raises(ConfigError, match=r"^cluster.mem_gb=null \(assumed 1000.0 GB\): llama3_70b"):
        check_fits(cfg, build_layout(cfg))
    small = compose_run([*base, "cluster.node_mem_gb=1200"])
    with pytest.raises(ConfigError, match=r"^cluster.mem_gb=0, node_mem_gb=1200: llama3_70b .*set cluster.node_mem_gb"):
        check_fits(small, build_layout(small))
    for big in (compose_run([*base, "cluster.mem_gb=2000"]), compose_run(base)):
        assert estimate(big, build_layout(big)).fits


def test_config_dir_as_the_launcher_takes_it(tmp_path):
    """``--config-dir DIR`` finds a team's own cluster; the #1 line carries the directory, and
    the launcher accepts it as printed (dry run); giving hydra.searchpath too is refused."""
    (tmp_path / "cluster").mkdir()
    text = (REPO / "conf" / "cluster" / "a100x8.yaml").read_text().replace("name: a100x8", "name: ourcluster")
    (tmp_path / "cluster" / "ourcluster.yaml").write_text(text)
    proc = plan_cli(["--config-dir", str(tmp_path), "+cluster=ourcluster", "+model=llama3_8b"])
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("#1: "))
    assert line.startswith(f"#1: python -m launcher --config-dir {tmp_path} +cluster=ourcluster"), line
    launch = subprocess.run([sys.executable, *line[len("#1: python "):].split(), "launcher.dry_run=true"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True, text=True, timeout=120)
    assert launch.returncode == 0 and "#SBATCH" in launch.stdout, launch.stdout + launch.stderr
    both = plan_cli(["--config-dir", str(tmp_path), f"hydra.searchpath=[file://{tmp_path}]", "+cluster=ourcluster"])
    assert both.returncode == 2 and "give one of them" in both.stderr and both.stderr.count("\n") == 1
    assert plan_cli(["+cluster=ourcluster"]).returncode == 2  # not found without the directory
