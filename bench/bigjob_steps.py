"""The sequence of bench/bigjob_rank.py's rank (its docstring says what and why): placed,
built, two steps measured, the async save beside a third, the load, each section's
figures and its one-line verdict into ``result["sections"]``."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict

from bench.bigjob_parts import GIB, LAYERS, build, count, job_overrides, join, memory, memory_line, planned, \
    prepare, shards, size, step_once

GB = 1e9


def run(out: Path, result: Dict[str, Any], layers: int, micro_batch: int, dry: bool) -> None:
    from train.metrics import reset_peaks

    overrides = job_overrides(layers, micro_batch, dry)
    cfg, plan = prepare(out, overrides)
    result.update(overrides=overrides, plan={k: v for k, v in plan.items() if not isinstance(v, (dict, list))})
    layout, ctx = join(cfg, dry)
    sections = result["sections"]
    sections["affinity"] = affinity(out, cfg, layout, ctx, dry)
    import torch

    from bench.bigjob_save import LocalShards, OneRankSaver

    if dry:
        torch.set_num_threads(1)  # a tiny model: threads would only contend (CI's 2 cores)

    engine = build(cfg, layout, ctx)
    built = shards(engine, layout)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.train.seq_len + 1), generator=gen)
    batch, lr = (tokens[:, :-1], tokens[:, 1:]), cfg.optim.lr
    saver, local = OneRankSaver(), LocalShards(engine)
    saver.prepare()  # the loop's start-up: the checkpoint thread (its group: a fake one here)
    try:
        first = step_once(engine, batch, lr, ctx.device)
        saver.reserve(local)  # after the first step, as the loop does: the pinned buffers, in the background
        reset_peaks(ctx.device)
        second = step_once(engine, batch, lr, ctx.device)
    except torch.cuda.OutOfMemoryError as exc:  # the planner's figure beside what ran out
        sections["rank"] = {"ok": False, "line": f"out of memory (planned {plan['total_bytes'] / GIB:.1f} GiB a GPU): "
                            f"{str(exc).splitlines()[0][:400]}", "facts": {"memory": memory(engine, ctx.device)}}
        raise
    mem = memory(engine, ctx.device)
    sections["rank"] = rank_section(cfg, layout, plan, built, (first, second), mem, layers, dry)
    try:
        from bench.bigjob_save import content_crc, snapshot

        snap = snapshot(saver, local, out / "ckpt", lambda: step_once(engine, batch, lr, ctx.device)[0])
        snap["crc"] = content_crc(saver.taken)
        sections["snapshot"] = snapshot_section(snap, plan, second[0], ctx.device.type == "cuda")
        sections["save_load"] = save_load_section(local, out / "ckpt", snap)
    finally:
        saver.close()
        shutil.rmtree(out / "ckpt", ignore_errors=True)  # a 70B rank's state: ~1.7 GB


def rank_section(cfg, layout, plan, built, steps, mem, layers: int, dry: bool) -> Dict[str, Any]:
    per_rank = plan["params"] / (layout.dp_shard * layout.tp)
    line, ratio = memory_line(mem, plan)
    scaled = ""
    if not dry and layers != LAYERS:
        full = planned([o for o in job_overrides(LAYERS, cfg.train.micro_batch_size, dry)])
        scaled = (f"; at {layers} of {LAYERS} layers, the planner asked for {layers} too "
                  f"({LAYERS} layers planned: {full['total_bytes'] / GIB:.1f} GiB)")
    where = "CPU, a tiny model's shape" if dry else f"{cfg.model.n_layers} layers"
    head = (f"rank 0 of {layout.world_size} ({layout.nodes} x {layout.gpus_per_node}; dp_shard {layout.dp_shard} x tp "
            f"{layout.tp}), {cfg.model.name} ({where}), micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_len}, "
            f"AC {cfg.strategy.activation_checkpointing}")
    shapes = (f"{count(built['params'])} params in its shards ({built['params'] / per_rank:.3f} x the planner's "
              f"{count(per_rank)} a rank), " +
              ("every shard's shape as theory" if not built["wrong"] else f"{len(built['wrong'])} shapes not as theory"))
    timing = f"steps {steps[0][0]:.2f} s, {steps[1][0]:.2f} s (losses {steps[0][1]:.3g}, {steps[1][1]:.3g}: fake collectives)"
    return {"ok": not built["wrong"], "line": f"{line}{scaled}; {timing}; {head}: {shapes}",
            "facts": {"shards": built["shown"], "wrong": built["wrong"][:20], "local_params": built["params"],
                      "planned_params_a_rank": per_rank, "steps_s": [s[0] for s in steps],
                      "losses": [s[1] for s in steps], "memory": mem, "device_over_planned": ratio}}


def snapshot_section(snap: Dict[str, Any], plan, step2_s: float, cuda: bool) -> Dict[str, Any]:
    stall = snap["start_s"] + snap["wait_s"]
    pinned = f"{size(snap['pinned_bytes'])} pinned" if cuda else "not pinned on CPU"
    if snap.get("pool"):
        pinned += f" (the pinned pool: {size(snap['pool'])}, blocks rounded up to powers of two)"
    ok = snap["bytes"] > 0 and snap["pinned_bytes"] == snap["device_bytes"]  # every copy of a GPU tensor pinned
    line = (f"stall {stall:.3f} s (the save's start {snap['start_s']:.3f} + the next step's wait {snap['wait_s']:.3f}); "
            f"{size(snap['bytes'])} of state in {snap['tensors']} tensors, {pinned} (planner: "
            f"{size(plan.get('state_bytes_per_rank', 0))} of state a rank); copy {snap['copy_s']:.2f} s; "
            f"the step beside it {snap['step_s']:.2f} s (the one before: {step2_s:.2f} s)")
    return {"ok": ok, "line": line, "facts": dict(snap)}


def save_load_section(local, folder: Path, snap: Dict[str, Any]) -> Dict[str, Any]:
    from bench.bigjob_save import content_crc, load_back, refuses_a_flipped_byte

    changed = content_crc(local.state_dict()) != snap["crc"]  # the third step moved the state on
    loaded = load_back(local, folder)
    same = content_crc(local.state_dict()) == snap["crc"]  # the engine's own state, asked afresh
    flipped = refuses_a_flipped_byte(local, folder, loaded["owned"])
    written = loaded["file_bytes"]
    ok = same and changed and not flipped
    line = (f"save {written / GB:.3g} GB in {snap['write_s']:.2f} s = {written / GB / snap['write_s']:.3g} GB/s (DCP, "
            f"the summing writer, fsynced, to the scratch's disk); load {loaded['load_s']:.2f} s = "
            f"{written / GB / loaded['load_s']:.3g} GB/s from the disk (evicted), its CRC32 "
            f"{', '.join(loaded['crc'].values())} checked as read; the loaded state "
            f"{'=' if same else '!='} the snapshot (content CRC32 {snap['crc']:08x}"
            f"{'' if changed else '; the step beside the save had not changed it'}); a flipped byte "
            f"{'refused' if not flipped else 'NOT refused: ' + flipped}")
    facts = {"file_bytes": written, "write_s": snap["write_s"], "load_s": loaded["load_s"], "file_crc": loaded["crc"],
             "content_crc": f"{snap['crc']:08x}", "same": same, "changed_before_load": changed, "flipped": flipped}
    return {"ok": ok, "line": line, "facts": facts}


def affinity(out: Path, cfg, layout, ctx, dry: bool) -> Dict[str, Any]:
    """The rank placed as the harness places it (``bind_rank``; ``--dry``: ``plan`` on a fake
    sysfs tree), its CPUs against its GPU's ``local_cpulist``."""
    import dataclasses

    from train.harness import affinity as aff

    if dry:
        topo, gpus = fake_sysfs(out / "sysfs")
        placement = aff.plan(range(32), 0, layout.gpus_per_node, topo, gpu=gpus[0])
        cpus = list(placement.cpus)
    else:
        topo = aff.Topology()
        cluster = dataclasses.replace(cfg.cluster, gpu_binding="task")  # one GPU visible: the others from sysfs
        placement = aff.bind_rank(cluster, 0, layout.gpus_per_node, device=ctx.device, log=print, rank=0, env={})
        cpus = sorted(os.sched_getaffinity(0))
    near = topo.local_cpus(placement.gpu) if placement.gpu else []
    ok = bool(near) and bool(cpus) and set(cpus) <= set(near)
    where = "inside it" if ok else ("its local_cpulist unknown" if not near else "NOT inside it")
    line = (f"{placement.line(0)}; now on CPUs {aff.format_cpulist(cpus)}; GPU {placement.gpu}'s local_cpulist "
            f"{aff.format_cpulist(near) or '?'}: {where}" + (" (a fake sysfs tree: 2 NUMA nodes, 8 GPUs)" if dry else ""))
    return {"ok": ok, "line": line, "facts": {**placement.facts(), "cpus": aff.format_cpulist(cpus),
                                              "gpu": placement.gpu, "local_cpulist": aff.format_cpulist(near)}}


def fake_sysfs(root: Path):
    """A DGX-like node under ``root``: NUMA nodes 0-15 and 16-31, GPUs 0-3 on node 0 and
    4-7 on node 1 (their PCI addresses returned, in order)."""
    from train.harness.affinity import Topology

    def put(rel: str, text: str) -> None:
        path = root / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    put("devices/system/node/node0/cpulist", "0-15")
    put("devices/system/node/node1/cpulist", "16-31")
    gpus = [f"0000:{0x18 + 0x10 * i:02x}:00.0" for i in range(8)]
    for i, address in enumerate(gpus):
        for name, text in (("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", str(i // 4)),
                           ("local_cpulist", "0-15" if i < 4 else "16-31")):
            put(f"bus/pci/devices/{address}/{name}", text)
    return Topology(root), gpus
