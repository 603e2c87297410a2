"""The async checkpoint's snapshot in the memory plan: each rank's
checkpoint state (fp32 parameters + AdamW's two fp32 moments + its step counters) kept in
host buffers from save to save, page-locked on GPU clusters (each buffer a power of two:
torch's caching host allocator), counted per node beside offload, shown by the planner
and refused at launch where a node's memory is too small. Pure: no torch (the planner's
and the launcher's commands run forked from the warm server, as tests/test_plan.py's)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, launcher
from helpers import compose_run
from launcher.plan.gate import check_fits, memory_line
from launcher.plan.memory import estimate
from launcher.plan.state_bytes import snapshot_bytes_per_rank, state_bytes_per_rank
from spec.config import ConfigError
from spec.layout import build_layout
from spec.model_size import count_params, ffn_hidden_dim, param_breakdown

BIG = ["+cluster=h100x8", "cluster.nodes=4", "+model=llama3_70b", "+strategy=fsdp_tp", "checkpoint.async_save=true"]


def _plan(args):
    import warm

    return warm.run_module("launcher.plan", list(args), cwd=REPO, timeout=120)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _llama_rank_tensors(m, tp: int, shard: int) -> list:
    """Bytes of each fp32 parameter of the first rank of a (dp_shard, tp) mesh, written out
    for Llama (untied, no biases): tp.py's plan shards wq/wk/wv/w1/w3 and the vocab-parallel
    embedding and head along dim 0, wo/w2 along dim 1, and keeps the norms whole; FSDP2
    then takes the first ceil(rows / dp_shard) rows of that."""
    kv, f, d = m.n_kv_heads * (m.dim // m.n_heads), ffn_hidden_dim(m), m.dim
    block = [_ceil(d, shard),                      # attention_norm
             _ceil(d // tp, shard) * d,            # wq
             _ceil(kv // tp, shard) * d,           # wk
             _ceil(kv // tp, shard) * d,           # wv
             _ceil(d, shard) * (d // tp),          # wo
             _ceil(d, shard),                      # ffn_norm
             _ceil(f // tp, shard) * d,            # w1
             _ceil(d, shard) * (f // tp),          # w2
             _ceil(f // tp, shard) * d]            # w3
    root = [_ceil(m.vocab_size // tp, shard) * d, _ceil(d, shard), _ceil(m.vocab_size // tp, shard) * d]
    return [4 * n for n in block * m.n_layers + root]


def test_70b_fsdp_tp_snapshot_per_node_in_json_and_text():
    """70B with fsdp_tp on 4 x 8 H100 (tp 2, dp_shard 16): each rank's state is 12 bytes a
    parameter of its 1/32 (+ 4 bytes of AdamW step a tensor), about 211.7 GB per node;
    pinned, each buffer rounded up to a power of two, 236.0 GB per node."""
    cfg = compose_run(BIG)
    m, ranks = cfg.model, cfg.cluster.gpus_per_node
    tensors = _llama_rank_tensors(m, tp=2, shard=16)
    state = sum(3 * b + 4 for b in tensors)                    # parameter, exp_avg, exp_avg_sq, step
    pinned = sum(3 * _pow2(b) + _pow2(4) for b in tensors)
    assert state * ranks == pytest.approx(12 * count_params(m) / 4, rel=1e-4)  # 12 B/param over 4 nodes
    assert 211e9 < state * ranks < 212.5e9

    proc = _plan([*BIG[:-1], "checkpoint.async_save=true", "plan.format=json", "plan.top=0"])
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["state_bytes_per_rank"] == state
    assert row["snapshot_bytes_per_rank"] == pinned
    assert row["snapshot_bytes_per_node"] == pinned * ranks == row["host_bytes_per_node"]
    assert row["host_limit_bytes"] == 2000e9 and row["host_fits"] and row["fits"]
    print(f"70B fsdp_tp, 4 nodes: state {state * ranks / 1e9:.1f} GB per node, pinned snapshot "
          f"{pinned * ranks / 1e9:.1f} GB per node")

    text = _plan([*BIG, "plan.top=0"])
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if "snapshot" in x)
    assert f"host memory {pinned / 1e9:.1f} GB per rank ({state / 1e9:.1f} GB of state, pinned)" in line
    assert f"{pinned * ranks / 1e9:.1f} GB per node of 2000.0 GB" in line

    off = _plan([*BIG[:-1], "checkpoint.async_save=false", "plan.format=json", "plan.top=0"])
    (row,) = json.loads(off.stdout)
    assert row["snapshot_bytes_per_node"] == row["host_bytes_per_node"] == 0
    assert row["state_bytes_per_rank"] == state  # the checkpoint's state, saved either way


def test_the_launch_refuses_a_snapshot_bigger_than_the_node(tmp_path):
    """A node of 150 GB cannot hold the 236 GB snapshot: exit 2, one line naming the
    snapshot, its bytes per node and the fixes; with blocking saves the same run is accepted."""
    mem = estimate(compose_run(BIG), build_layout(compose_run(BIG)))
    proc = launcher([*BIG, "cluster.node_mem_gb=150", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: checkpoint.async_save=true: the async checkpoint's snapshot of llama3_70b")
    assert f"{mem.snapshot_per_node / 1e9:.1f} GB of host memory per node" in line
    assert "cluster.mem_gb=0, node_mem_gb=150" in line and "more than the 150.0 GB" in line
    assert "use checkpoint.async_save=false" in line
    assert "cluster.nodes=8" in line  # fsdp_tp: twice the ranks, half the state per node
    assert f"cluster.node_mem_gb={-(-mem.snapshot_per_node // 1e9):.0f} if the node has" in line
    assert not list(tmp_path.rglob("config.yaml"))  # nothing written

    ok = launcher([*BIG[:-1], "checkpoint.async_save=false", "cluster.node_mem_gb=150", "launcher.dry_run=true"],
                  cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "dry run: nothing submitted" in ok.stdout


def test_each_suggested_fix_is_accepted():
    """The refusal's fixes, applied, pass the gate: blocking saves, the node count it
    names, the node memory it names."""
    base = [*BIG, "cluster.node_mem_gb=150"]
    cfg = compose_run(base)
    with pytest.raises(ConfigError) as exc:
        check_fits(cfg, build_layout(cfg))
    message = str(exc.value)
    fixes = message.split("; use ", 1)[1].rsplit(", or launcher.allow_oom=true", 1)[0].split(" or ")
    words = [fix.split(" (")[0].split(" if ")[0].split() for fix in fixes]
    assert [w[0].split("=")[0] for w in words] == ["checkpoint.async_save", "cluster.nodes", "cluster.node_mem_gb"]
    for fix in words:
        fixed = compose_run([*base, *fix])
        check_fits(fixed, build_layout(fixed))


@pytest.mark.parametrize("overrides, fix", [
    ([*BIG, "cluster.mem_gb=200"], "cluster.mem_gb=236 if the node has that much memory"),
    # mem_gb null: 1000 GB assumed; a GPU of 400 GB (hypothetical) holds 405B's 1/32, whose
    # snapshot takes 1215 GB of state a node
    (["+cluster=h100x8", "cluster.nodes=4", "+model=llama3_405b", "+strategy=fsdp", "cluster.gpu_mem_gb=400",
      "cluster.mem_gb=null", "checkpoint.async_save=true"], "cluster.mem_gb=0 cluster.node_mem_gb="),
])
def test_the_memory_fix_names_the_field_the_job_takes_memory_from(overrides, fix):
    """cluster.mem_gb=N: the fix is a larger mem_gb; mem_gb null (1000 GB assumed): mem_gb=0
    with the node's memory. (The GPUs fit in both: the snapshot alone is refused.)"""
    cfg = compose_run(overrides)
    mem = estimate(cfg, build_layout(cfg))
    assert mem.total_bytes <= mem.gpu_bytes and not mem.host_fits
    with pytest.raises(ConfigError) as exc:
        check_fits(cfg, build_layout(cfg))
    assert fix in str(exc.value) and "snapshot" in str(exc.value), str(exc.value)


def test_ddp_holds_the_whole_state_fsdp_its_shard():
    """DDP: every rank's snapshot is the whole state (12 B a parameter + 4 a tensor);
    FSDP: the parameters' part divided by dp_shard (tiny's dims divide by 8), the step
    counters not. A tied head is one tensor under two state-dict keys: its weight twice."""
    ddp = compose_run(["+cluster=h100x8", "+strategy=ddp", "checkpoint.async_save=true"])
    fsdp = compose_run(["+cluster=h100x8", "+strategy=fsdp", "checkpoint.async_save=true"])
    tied = compose_run(["+cluster=h100x8", "+strategy=ddp", "checkpoint.async_save=true", "model.tie_embeddings=true"])
    n = count_params(ddp.model)
    tensors = 9 * ddp.model.n_layers + 3  # per block: 2 norms, 7 matrices; embedding, final norm, head
    assert state_bytes_per_rank(ddp, build_layout(ddp)) == 12 * n + 4 * tensors
    assert build_layout(fsdp).dp_shard == 8
    assert state_bytes_per_rank(fsdp, build_layout(fsdp)) == 12 * n / 8 + 4 * tensors
    embedding = param_breakdown(tied.model).embedding
    assert state_bytes_per_rank(tied, build_layout(tied)) == 12 * count_params(tied.model) + 4 * embedding \
        + 4 * (tensors - 1)
    for cfg in (ddp, fsdp):
        mem = estimate(cfg, build_layout(cfg))
        state = state_bytes_per_rank(cfg, build_layout(cfg))
        assert state <= mem.snapshot_bytes < 2 * state  # each buffer rounded up to a power of two
        assert mem.snapshot_per_node == mem.host_per_node == 8 * mem.snapshot_bytes


def test_no_snapshot_where_saves_block():
    """async_save=false, DeepSpeed (whose saves block whatever async_save says), and a CPU
    cluster by default (null: async on GPU clusters only) keep nothing in host memory; a
    CPU run told to save async keeps plain buffers of the state's size."""
    for overrides in (["+cluster=h100x8", "+strategy=fsdp", "checkpoint.async_save=false"],
                      ["+cluster=h100x8", "+strategy=zero3", "checkpoint.async_save=true"],
                      ["+strategy=ddp"]):
        cfg = compose_run(overrides)
        mem = estimate(cfg, build_layout(cfg))
        assert mem.snapshot_bytes == mem.snapshot_per_node == 0, overrides
    on = compose_run(["+cluster=h100x8", "+strategy=fsdp"])  # null on a GPU cluster: async
    assert estimate(on, build_layout(on)).snapshot_bytes > 0
    cpu = compose_run(["+strategy=ddp", "checkpoint.async_save=true"])
    layout = build_layout(cpu)
    assert estimate(cpu, layout).snapshot_bytes == snapshot_bytes_per_rank(cpu, layout) \
        == state_bytes_per_rank(cpu, layout)


def test_the_dry_runs_memory_line_names_host_memory_with_a_snapshot():
    cfg = compose_run(BIG)
    mem = estimate(cfg, build_layout(cfg))
    line = memory_line(cfg, build_layout(cfg))
    assert f"host memory {mem.host_per_node / 1e9:.1f} GB per node of 2000.0" in line and "snapshot" in line
    off = compose_run([*BIG[:-1], "checkpoint.async_save=false"])
    assert "host memory" not in memory_line(off, build_layout(off))
