"""Context parallel (``strategy.cp``): each sequence split over ranks, attention over heads.

Numerics on 4 gloo ranks forked warm (tests/warm.py), every engine built as the trainer
builds it (train/parallelize.py) and fed by the trainer's loaders: the same global batch
of 4 sequences a step for 10 steps at cp 1 (DDP over 4), cp 2 (DDP 2 x cp 2), cp 4
(DDP 1 x cp 4, two micro-batches accumulated) and FSDP dp_shard 2 x cp 2, on token data
(causal attention), chat data (the loss mask; the head and loss in chunks of 8 tokens)
and packed chat data (documents' masks and positions), and FSDP x TP 2 x cp 2 on packed
data: the losses and grad norms of every split equal cp 1's within 1e-5 (fp32). cp 4
over 2 K/V heads repeats them (one a rank). The all-to-all itself against a reference permutation; the refusals.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import warm
from helpers import compose_run
from launcher.local import free_port
from spec.config import ConfigError
from spec.layout import build_layout
from test_chat_data import run_prepare

STEPS = 10
WORLD = 4
SPLITS = {  # name: overrides; every one a global batch of 4 sequences
    "cp1": ["+strategy=ddp", "train.micro_batch_size=1"],
    "cp2": ["+strategy=ddp", "strategy.cp=2", "train.micro_batch_size=1", "train.grad_accum=2"],
    "cp4": ["+strategy=ddp", "strategy.cp=4", "train.micro_batch_size=2", "train.grad_accum=2"],
    "fsdp2_cp2": ["+strategy=fsdp", "strategy.cp=2", "train.micro_batch_size=2"],
}
TP_CP = ["+strategy=fsdp_tp", "strategy.tensor_parallel=2", "strategy.cp=2", "train.micro_batch_size=2",
         "train.grad_accum=2"]  # heads split by TP, then by cp
DATA = {
    "tokens": ["train.seq_len=32", "data.num_tokens=20000"],
    "chat": ["data.source=chat", "train.seq_len=128", "model.vocab_size=384", "model.loss_chunk_tokens=8"],
    "packed": ["data.source=chat", "data.packing=true", "train.seq_len=128", "model.vocab_size=384"],
}


def train_splits(rank: int, world: int, port: int, cfgs: dict, out_dir: str) -> None:
    """Each config's engine and loader on this rank, 10 steps: the global loss and grad norm."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from train.data import build_loader
    from train.harness.dist import init_distributed, shutdown
    from train.model import build_model, head_loss_chunk
    from train.parallelize import parallelize

    ctx = init_distributed(120)
    curves = {}
    for name, cfg in cfgs.items():
        layout = build_layout(cfg)
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, "meta")
        model.loss_chunk = head_loss_chunk(cfg, ctx.device)
        engine = parallelize(model, cfg, layout, ctx)
        loader = build_loader(cfg, layout.dp_rank(rank), layout.dp, cp_rank=layout.cp_rank(rank))
        losses, norms = [], []
        for _ in range(STEPS):
            batches = loader.next_step()
            loss, norm = engine.train_step(batches, 3e-3, loader.loss_share)
            total = loss.detach().clone()
            dist.all_reduce(total)  # as the loop's agreement: the ranks' parts summed over the world
            losses.append(total.item() / world)
            norms.append(norm.item())
        curves[name] = {"loss": losses, "grad_norm": norms,
                        "tokens": int(sum(b[0].shape[1] for b in batches[:1]))}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(curves))
    shutdown()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return run_prepare(tmp_path_factory.mktemp("chat"), "--max-length", "65")[0]


@pytest.fixture(scope="module")
def curves(tmp_path_factory, chat_dir):
    """{data kind: {split: curve}} from one 4-rank job that runs them all."""
    tmp = tmp_path_factory.mktemp("cp")
    common = ["cluster.gpus_per_node=4", "strategy.mixed_precision=fp32", "model.n_heads=4",
              f"data.cache_dir={tmp}/cache", f"data.path={chat_dir}"]
    cfgs = {f"{kind}/{split}": compose_run(common + data + over)
            for kind, data in DATA.items() for split, over in SPLITS.items()}
    cfgs["tokens/cp4_kv2"] = compose_run(common + DATA["tokens"] + SPLITS["cp4"] + ["model.n_kv_heads=2"])
    cfgs["tokens/cp1_kv2"] = compose_run(common + DATA["tokens"] + SPLITS["cp1"] + ["model.n_kv_heads=2"])
    cfgs["packed/tp2_cp2"] = compose_run(common + DATA["packed"] + TP_CP)
    proc = warm.call_ranks(train_splits, WORLD, (WORLD, free_port(), cfgs, str(tmp)), cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp / f"{r}.json").read_text()) for r in range(WORLD)]
    for name in cfgs:  # every rank agrees on the global figures
        assert all(r[name]["loss"] == ranks[0][name]["loss"] for r in ranks), name
    out: dict = {}
    for name, curve in ranks[0].items():
        kind, split = name.split("/")
        out.setdefault(kind, {})[split] = curve
    return out


@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("split", [s for s in SPLITS if s != "cp1"])
def test_split_sequences_train_as_whole_ones(curves, kind, split):
    ref, got = curves[kind]["cp1"], curves[kind][split]
    assert len(ref["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0]  # it trains
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=0)


def test_each_rank_holds_its_slice_and_kv_heads_repeat(curves):
    seq = {"tokens": 32, "chat": 128, "packed": 128}
    for kind, by_split in curves.items():
        assert by_split["cp1"]["tokens"] == seq[kind] and by_split["cp4"]["tokens"] == seq[kind] // 4
    ref, got = curves["tokens"]["cp1_kv2"], curves["tokens"]["cp4_kv2"]
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=0)


def test_tensor_parallel_then_cp_trains_as_whole_sequences(curves):
    """FSDP x TP 2 x cp 2 on packed data: each rank attends with n_heads / 4 heads."""
    ref, got = curves["packed"]["cp1"], curves["packed"]["tp2_cp2"]
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=0)


def _refused(overrides: list) -> str:
    with pytest.raises(ConfigError) as err:
        build_layout(compose_run(["cluster.gpus_per_node=4", *overrides]))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides,says", [
    (["+strategy=pp", "strategy.cp=2"], "pipeline_parallel=2"),
    (["+strategy=zero3", "strategy.cp=2"], "strategy.engine=deepspeed"),
    (["+strategy=fsdp_tp", "strategy.cp=4", "cluster.gpus_per_node=8"], "model.n_heads=4 / tensor_parallel=2"),
    (["+strategy=fsdp", "strategy.cp=4", "model.n_heads=4", "model.n_kv_heads=2", "cluster.gpus_per_node=8"], None),
    (["+strategy=fsdp", "strategy.cp=3", "model.n_heads=6", "model.dim=48", "cluster.gpus_per_node=3",
      "train.seq_len=32"], "train.seq_len=32"),
    (["+strategy=fsdp", "strategy.cp=4", "model.n_heads=6", "model.dim=48"], "model.n_heads=6"),
    (["+strategy=fsdp", "strategy.cp=4", "model.n_heads=12", "model.n_kv_heads=6", "model.dim=48"],
     "model.n_kv_heads=6"),
    (["+strategy=fsdp", "strategy.cp=2", "strategy.compile=true"], "strategy.compile=true"),
    (["+strategy=fsdp", "strategy.cp=0"], "strategy.cp=0"),
])
def test_what_cannot_split_is_refused_in_one_line(overrides, says):
    if says is None:  # cp 4 a multiple of 2 K/V heads: taken (each repeated twice)
        layout = build_layout(compose_run(["cluster.gpus_per_node=8", *overrides]))
        assert (layout.cp, layout.dp_shard) == (4, 2)
        return
    message = _refused(overrides)
    assert says in message and "strategy.cp" in message and "use " in message, message


def test_all_to_all_trades_sequence_slices_for_head_groups(tmp_path):
    proc = warm.call_ranks(all_to_all_round_trip, 2, (2, free_port(), str(tmp_path)), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "ok.json").read_text()) == [True, True]


def all_to_all_round_trip(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank r holds slice r of a known (b, s, h, d) tensor; after the first all-to-all it
    holds head group r of the whole sequence; the gradient comes back to the slices."""
    import torch
    import torch.distributed as dist

    from train.context_parallel import HeadSplit, sequence_slice

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    full = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).reshape(2, 8, 4, 3)
    mine = full[:, sequence_slice(8, rank, world)].clone().requires_grad_(True)
    split = HeadSplit(dist.group.WORLD, world)
    q, _, _ = split.to_heads(mine, mine, mine)
    ok = torch.equal(q, full[:, :, rank * 2:(rank + 1) * 2])
    back = split.to_sequence(q * (rank + 1))
    (back * 1.0).sum().backward()
    heads = torch.tensor([1.0, 1.0, 2.0, 2.0])[None, None, :, None]  # head group g scaled by g + 1
    ok = ok and torch.equal(mine.grad, heads.expand_as(mine))  # k and v unused: q's gradient only
    results = [None] * world
    dist.all_gather_object(results, bool(ok))
    if rank == 0:
        Path(out_dir, "ok.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture
def fake_world():
    """init(rank, world) joins a fake process group (one rank of a big job); torn down after."""
    import torch.distributed as dist

    from train.torch_compat import fake_process_group

    yield fake_process_group
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy,cp", [("fsdp", 4), ("hsdp", 4), ("fsdp", 8), ("ddp", 2), ("fsdp_tp", 2)])
def test_cp_groups_sit_inside_a_node_and_gradients_reduce_over_dp_and_cp(fake_world, strategy, cp):
    """128 ranks (16 nodes x 8) of llama3_8b (8 K/V heads), one rank per job built: the cp
    group is consecutive ranks of one node (every tp-th with TP innermost); FSDP shards over dp_shard x cp (HSDP: inside
    the node, replicated across), DDP averages over dp x cp."""
    from spec.layout import AXES
    from train.mesh import build_mesh, data_parallel_mesh, dp_mesh

    layout = build_layout(compose_run(["+model=llama3_8b", "cluster.nodes=16", "cluster.gpus_per_node=8",
                                       f"+strategy={strategy}", f"strategy.cp={cp}"]))
    assert layout.cp == cp and layout.dp * cp * layout.tp == layout.world_size == 128
    for rank in (0, 77, 127):
        fake_world(rank, layout.world_size)
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == AXES and dict(zip(AXES, mesh.get_coordinate())) == layout.coords(rank)
        group, tp = mesh["cp"].mesh.tolist(), layout.tp  # consecutive ranks, tp apart
        assert rank in group and group == list(range(group[0], group[0] + cp * tp, tp))
        assert len({r // 8 for r in group}) == 1
        assert data_parallel_mesh(mesh).size() == layout.dp * cp
        shard = dp_mesh(mesh, layout)
        if strategy == "hsdp":
            assert shard.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and shard.size() == 128
            assert {r // 8 for r in shard["dp_shard_cp"].mesh.tolist()} == {rank // 8}
        elif strategy.startswith("fsdp"):
            assert shard.size() == layout.dp_shard * cp == 128 // layout.tp
        import torch.distributed as dist

        dist.destroy_process_group()


def test_a_cp2_checkpoint_resumes_at_cp1(tmp_path):
    """Through the launcher: DDP 1 x cp 2 on 2 ranks fails at step 7 with its checkpoint of
    step 4; ``launcher.resume ... strategy.cp=1`` on one rank completes it, and every step's
    loss equals an uninterrupted one-rank run's (the checkpoint's weights, optimizer and data
    position came through the change of split)."""
    from spec.rundir import read_metrics, read_run_json

    base = ["train.steps=10", "train.seq_len=32", "data.num_tokens=20000", "train.micro_batch_size=4",
            "strategy.mixed_precision=fp32", f"data.cache_dir={tmp_path}/cache", "train.eval_every=2"]
    ref = warm.launcher(base + ["cluster.gpus_per_node=1", f"launcher.run_dir={tmp_path}/ref"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    run = tmp_path / "run"
    failed = warm.launcher(base + ["cluster.gpus_per_node=2", "strategy.cp=2", "checkpoint.every_steps=4",
                                   "checkpoint.save_final=false", "fault.raise_at_step=7",
                                   f"launcher.run_dir={run}"], cwd=tmp_path)
    assert failed.returncode != 0 and read_run_json(run)["status"] == "failed", failed.stdout + failed.stderr
    assert "'cp': 1" in (run / "logs" / "rank1.log").read_text()  # rank 1 held the second half
    resumed = warm.run_module("launcher.resume", [str(run), "strategy.cp=1", "cluster.gpus_per_node=1",
                                                  "fault.raise_at_step=0"], cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    info = read_run_json(run)
    assert info["status"] == "completed" and info["world_size"] == 1 and info["reshaped"][0]["at_step"] == 4
    got = {r["step"]: r["loss"] for r in read_metrics(run)}
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref")}
    assert sorted(got) == sorted(want) == list(range(1, 11))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=0, atol=1e-5)
    # the validation loss of the cp 2 segment (steps 2 and 4, before its checkpoint) too
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if r.get("segment") == 0 and r.get("val_loss") is not None}
    ref_val = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "ref") if r.get("val_loss") is not None}
    assert {2, 4} <= set(val), rows
    np.testing.assert_allclose([val[2], val[4]], [ref_val[2], ref_val[4]], rtol=0, atol=1e-5)
