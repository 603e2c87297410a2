"""Parallel layout: degrees, ``-1`` filling, placement rules, rank coordinates.

Pure (no torch): the launcher checks a layout with this code before submitting and
every task builds its mesh from the same value. The mesh axes are, outermost first,
``(pp, dp_replicate, dp_shard, cp, tp)`` (torchtitan's order). Ranks are numbered
node-major (rank = node * gpus_per_node + local_rank), so the innermost axis (tensor
parallel) takes consecutive ranks: as long as tp divides gpus_per_node, a TP group never
leaves a node; context parallel (``strategy.cp``, spec/context_parallel.py) comes next,
inside the node while tp x cp fits in it, its all-to-alls on the NVLink domain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from spec.config import ConfigError, RunConfig
from spec.context_parallel import check_context_parallel

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    nodes: int
    gpus_per_node: int
    nvlink_domain: int
    #: Context parallel: ranks one sequence is split over (the same batch, slices of it).
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> Tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def coords(self, rank: int) -> Dict[str, int]:
        """Mesh coordinates of a global rank (row-major over AXES)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        out: Dict[str, int] = {}
        rest = rank
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in AXES}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def cp_rank(self, rank: int) -> int:
        """Which slice of each sequence ``rank`` holds (0 .. cp-1)."""
        return self.coords(rank)["cp"]

    def placement(self, rank: int) -> Tuple[int, int]:
        """(node index, local rank) of a global rank."""
        return divmod(rank, self.gpus_per_node)

    def rank_table(self, hostnames: List[str] | None = None) -> List[Dict[str, object]]:
        rows = []
        for rank in range(self.world_size):
            node, local = self.placement(rank)
            row: Dict[str, object] = {"rank": rank, "node": node, "local_rank": local}
            if hostnames is not None:
                row["host"] = hostnames[node] if node < len(hostnames) else "?"
            row.update(self.coords(rank))
            row["dp"] = self.dp_rank(rank)
            rows.append(row)
        return rows

    def describe(self) -> str:
        return (f"world {self.world_size} = {self.nodes} nodes x {self.gpus_per_node}/node = "
                f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}"
                + (f" x cp {self.cp}" if self.cp > 1 else "") + f" x tp {self.tp}")


def _check_degrees(degrees: Dict[str, int]) -> None:
    for key, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(f"strategy.{key}={value} is invalid; use a positive degree or -1 (fill the rest)")


def _fill(degrees: Dict[str, int], world: int) -> Dict[str, int]:
    free = [k for k, v in degrees.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"only one degree may be -1, got {', '.join('strategy.' + k for k in free)}=-1; "
                          "set all but one explicitly")
    fixed = 1
    for key, value in degrees.items():
        if value != -1:
            fixed *= value
    if free:
        if world % fixed:
            raise ConfigError(f"world {world} is not divisible by the fixed degrees' product {fixed} "
                              f"({_fmt(degrees)}); choose degrees dividing {world}")
        degrees = dict(degrees, **{free[0]: world // fixed})
    elif fixed != world:
        raise ConfigError(f"world {world} != {_fmt(degrees)} = {fixed}; set one degree to -1 "
                          f"or make the product {world}")
    return degrees


def _fmt(degrees: Dict[str, int]) -> str:
    return " x ".join(f"strategy.{k}={v}" for k, v in degrees.items())


def _check_tp(tp: int, gpus_per_node: int, domain: int, cluster: str) -> None:
    if tp > gpus_per_node or gpus_per_node % tp:
        raise ConfigError(f"strategy.tensor_parallel={tp} does not divide cluster.gpus_per_node={gpus_per_node} "
                          f"on cluster {cluster}: TP must stay inside one node; use a tensor_parallel "
                          f"dividing {gpus_per_node}")
    if tp > domain:
        raise ConfigError(f"strategy.tensor_parallel={tp} exceeds cluster.nvlink_domain={domain} on cluster "
                          f"{cluster}: TP must stay inside one NVLink domain; use tensor_parallel<={domain}")


def build_layout(cfg: RunConfig) -> Layout:
    """Fill ``-1`` and check every placement rule; raise ConfigError naming the fix."""
    c, s = cfg.cluster, cfg.strategy
    if c.nodes < 1:
        raise ConfigError(f"cluster.nodes={c.nodes} must be >= 1; use cluster.nodes=1 or more")
    if c.gpus_per_node < 1:
        raise ConfigError(f"cluster.gpus_per_node={c.gpus_per_node} must be >= 1")
    # A job that uses fewer GPUs per node than one NVLink domain holds has them all in one
    # domain: a sweep over gpus_per_node=1,2,4,8 on an 8-GPU NVLink node runs every point.
    domain = min(c.nvlink_domain or c.gpus_per_node, c.gpus_per_node)
    if c.gpus_per_node % domain:
        fits = [d for d in range(domain, 0, -1) if c.gpus_per_node % d == 0][0]
        raise ConfigError(f"cluster.nvlink_domain={domain} must divide cluster.gpus_per_node={c.gpus_per_node} "
                          f"(GPUs of a node in NVLink islands of {domain}); use cluster.gpus_per_node as a "
                          f"multiple of {domain}, or cluster.nvlink_domain={fits}")
    world = c.nodes * c.gpus_per_node
    raw = {"pipeline_parallel": s.pipeline_parallel, "dp_replicate": s.dp_replicate,
           "dp_shard": s.dp_shard, "tensor_parallel": s.tensor_parallel}
    if s.cp != 1:  # a fixed degree (no -1): named in messages only where it is used
        if s.cp < 1:
            raise ConfigError(f"strategy.cp={s.cp} is invalid; use strategy.cp=1 (off) or a degree >= 2")
        raw["cp"] = s.cp
    _check_degrees(raw)
    if s.tensor_parallel != -1:
        _check_tp(s.tensor_parallel, c.gpus_per_node, domain, c.name)  # the clearer message first
    degrees = _fill(raw, world)
    tp = degrees["tensor_parallel"]
    _check_tp(tp, c.gpus_per_node, domain, c.name)
    if s.engine == "deepspeed" and degrees["pipeline_parallel"] > 1 and s.zero_stage > 1:
        raise ConfigError(f"strategy.zero_stage={s.zero_stage} with pipeline_parallel={degrees['pipeline_parallel']}: "
                          "DeepSpeed pipeline parallel supports ZeRO stage 0 or 1 only; use strategy.zero_stage<=1")
    if s.data_parallel == "ddp" and s.engine == "torch" and degrees["dp_shard"] > 1:
        raise ConfigError(f"strategy.dp_shard={degrees['dp_shard']} with data_parallel=ddp: DDP does not shard; "
                          "use +strategy=fsdp or strategy.dp_shard=1")
    layout = Layout(pp=degrees["pipeline_parallel"], dp_replicate=degrees["dp_replicate"],
                    dp_shard=degrees["dp_shard"], tp=tp, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
                    nvlink_domain=domain, cp=degrees.get("cp", 1))
    check_context_parallel(cfg, layout)
    m = cfg.model
    kv = m.n_kv_heads or m.n_heads
    if layout.tp > 1 and (m.n_heads % layout.tp or kv % layout.tp):
        raise ConfigError(f"strategy.tensor_parallel={layout.tp} must divide model.n_heads={m.n_heads} and "
                          f"n_kv_heads={kv}; pick a tensor_parallel dividing both")
    if layout.pp > m.n_layers:
        raise ConfigError(f"strategy.pipeline_parallel={layout.pp} exceeds model.n_layers={m.n_layers}; "
                          f"use pipeline_parallel<={m.n_layers}")
    return layout
