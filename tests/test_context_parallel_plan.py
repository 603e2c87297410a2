"""The planner under context parallel (``strategy.cp``), pure (no torch): a rank's
activations are its seq_len / cp tokens', FSDP's states shard over dp_shard x cp, and the
step time adds the all-to-alls around attention; open-r1's recipe (docs/finetune.md, "Long
sequences"): FSDP at cp 2 leaves room at 32k tokens, cp 4 runs 65k."""
from __future__ import annotations

import pytest

from helpers import compose_run
from launcher.plan.costmodel import cp_all_to_all_bytes, step_time
from launcher.plan.memory import estimate
from spec.layout import build_layout

GB = 1e9


def recipe(cp: int, seq: int = 32768, *extra: str):
    """The recipe under FSDP on one h100x8 node, its global batch of 128 kept (accumulation x cp)."""
    cfg = compose_run(["+cluster=h100x8", "+experiment=r1_distill_sft", "strategy=fsdp", f"strategy.cp={cp}",
                       f"train.grad_accum={8 * cp}", f"train.seq_len={seq}", f"model.max_seq_len={max(seq, 32768)}",
                       *extra])
    layout = build_layout(cfg)
    return cfg, layout, estimate(cfg, layout), step_time(cfg, layout)


def test_activations_divide_by_cp_and_states_shard_over_dp_and_cp():
    _, _, one, _ = recipe(1)
    cfg, layout, two, _ = recipe(2)
    assert (layout.dp_shard, layout.cp, layout.dp) == (4, 2, 4)
    assert cfg.train.micro_batch_size * cfg.train.grad_accum * layout.dp == 128  # the recipe's global batch
    # the same 8-way sharding of params, grads and Adam; half the tokens a rank
    assert (two.param_bytes, two.grad_bytes, two.optimizer_bytes) == (one.param_bytes, one.grad_bytes,
                                                                      one.optimizer_bytes)
    for mode, acts in one.activations_by_mode.items():
        assert two.activations_by_mode[mode] == pytest.approx(acts / 2, rel=0.05), mode


def test_the_all_to_all_volume_and_its_time():
    cfg, layout, _, time = recipe(2)
    m, t = cfg.model, cfg.train
    # per block q (28 heads) and output (28), k and v (4 K/V heads) of 128 channels, bf16,
    # half of the rank's 32768 tokens sent, forward + backward + the recomputed forward
    per_layer = (28 + 28 + 4 + 4) * 128 * 2 * (2 * 32768 / 2) / 2
    assert cp_all_to_all_bytes(cfg, layout) == pytest.approx(3 * m.n_layers * per_layer)
    assert time.cp_comm_s == pytest.approx(cp_all_to_all_bytes(cfg, layout) * t.grad_accum
                                           / (cfg.cluster.intra_node_gbps * 1e9))
    assert time.step_s == pytest.approx(time.compute_s + time.exposed_dp_s + time.cp_comm_s)
    _, _, _, four = recipe(4)
    assert four.compute_s == pytest.approx(time.compute_s)  # the same tokens a GPU a step
    assert time.cp_comm_s < four.cp_comm_s < 2 * time.cp_comm_s  # (cp-1)/cp of a volume that does not grow
    # with TP 2 first: each rank sends its 14 query and 2 K/V heads, half the bytes
    tp_cfg, tp_layout, _, _ = recipe(2, 32768, "strategy.tensor_parallel=2")
    assert (tp_layout.tp, tp_layout.cp, tp_layout.dp_shard) == (2, 2, 2)
    assert cp_all_to_all_bytes(tp_cfg, tp_layout) == pytest.approx(cp_all_to_all_bytes(cfg, layout) / 2)
    # 4 K/V heads over cp 28 (a multiple): each repeated 7 times before the all-to-all
    many = compose_run(["+cluster=h100x8", "+experiment=r1_distill_sft", "strategy=fsdp", "strategy.cp=28",
                        "cluster.gpus_per_node=28", "cluster.nvlink_domain=28", "train.seq_len=28672"])
    tokens = 2 * 28672 / 28
    assert cp_all_to_all_bytes(many, build_layout(many)) == pytest.approx(
        3 * m.n_layers * (28 + 28 + 2 * 4 * 7) * 128 * 2 * tokens * 27 / 28)


def test_the_recipe_leaves_room_at_32k_and_runs_65k():
    """The figures docs/finetune.md gives (GB per H100 of 80)."""
    _, _, one, _ = recipe(1)
    _, _, two, _ = recipe(2)
    _, _, four_65k, _ = recipe(4, 65536)
    _, _, one_65k, _ = recipe(1, 65536)
    assert round(one.total_bytes / GB, 1) == 76.1 and one.fits
    assert round(two.total_bytes / GB, 1) == 50.2 and two.fits
    assert round(four_65k.total_bytes / GB, 1) == 50.2 and four_65k.fits
    assert not one_65k.fits
    _, _, one_65k_mb1, _ = recipe(1, 65536, "train.micro_batch_size=1", "train.grad_accum=16")
    _, _, four_131k, _ = recipe(4, 131072)
    assert round(one_65k_mb1.total_bytes / GB, 1) == round(four_131k.total_bytes / GB, 1) == 76.1


def test_a_recipe_s_strategy_is_overridden_without_a_plus():
    """``+experiment=r1_distill_sft`` puts zero3 in the defaults list: ``strategy=fsdp``
    overrides it (Hydra's rule; ``+strategy=fsdp`` would be a second value), where without
    the recipe the group must still be appended."""
    from launcher.overrides import check_overrides
    from spec.config import ConfigError

    check_overrides(["+experiment=r1_distill_sft", "strategy=fsdp", "strategy.cp=2"], multirun=False)
    with pytest.raises(ConfigError, match=r"append it with \+strategy=fsdp"):
        check_overrides(["strategy=fsdp", "strategy.cp=2"], multirun=False)


def test_the_ranking_names_context_parallel_where_a_long_sequence_does_not_fit_without():
    """At 65k tokens FSDP 8 at cp 1 does not fit (127.8 GB): the ranked layouts split each
    sequence (cp 2 with full recomputation, cp 4), the global batch of 128 sequences kept
    (grad_accum x cp); the #1 line names strategy.cp. Below CP_FROM_SEQ no cp is tried,
    and a user's cp is counted: the global batch is that of dp = world / cp."""
    from launcher.plan.cli import recommend_table
    from launcher.plan.costmodel import CP_FROM_SEQ, candidates, nearest_runnable

    cfg, _, _, _ = recipe(1, 65536)
    found = candidates(cfg, 128)
    assert found and all(k.layout.cp > 1 for k in found), [(k.cfg.strategy.name, k.layout.cp) for k in found]
    best = found[0]
    assert best.layout.cp * best.layout.dp == 8 and best.memory.fits
    assert best.cfg.train.micro_batch_size * best.cfg.train.grad_accum * best.layout.dp == 128
    assert f"strategy.cp={best.layout.cp}" in best.overrides() and "strategy.cp=" not in best.overrides(best.layout.cp)
    table = recommend_table(found, 3, cfg, 128)
    assert " cp tp " in table[1] and f"strategy.cp={best.layout.cp}" in table[-1], table
    short, _, _, _ = recipe(1, 8192)
    assert short.train.seq_len < CP_FROM_SEQ and all(k.layout.cp == 1 for k in candidates(short, 128))
    assert " cp " not in recommend_table(candidates(short, 128), 3, short, 128)[1]
    whole = candidates(short, 128)[0]  # cp 1 where the user gave cp 4: named, to undo it
    assert "strategy.cp=" not in whole.overrides() and whole.overrides(user_cp=4).endswith("strategy.cp=1")
    nearest = nearest_runnable(cfg)  # the user's batch of 2 x 8 x 8 sequences, no layout needed more nodes
    assert nearest is not None and nearest.cfg.cluster.nodes == 1 and nearest.layout.cp > 1
    four, _, _, _ = recipe(4, 65536)  # strategy.cp=4, grad_accum 32: the recipe's 128 sequences
    assert all(k.cfg.train.micro_batch_size * k.cfg.train.grad_accum * k.layout.dp == 128 for k in candidates(four))
