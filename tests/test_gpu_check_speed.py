"""The speed rows of `make gpu-check` beyond their runs (bench/gpu_check_speed.py): the
planner's predicted step and memory beside the measured ones, the loss rows
(bench/chunked_loss.py --gpu, its --dry on the CPU), the calibration of the planner's GPU
constants from a synthetic table (bench/calibrate_planner.py), and torchtitan's row's
checks that need no torchtitan."""
from __future__ import annotations

import argparse
import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # bench/chunked_loss.py imports its neighbours as a script does

from bench import calibrate_planner as cal  # noqa: E402
from bench import gpu_check_speed as gs  # noqa: E402
from bench.gpu_check_runner import Row, exited_ok  # noqa: E402

GIB = 2**30


def _metrics(run_dir, step_s=0.5, peak=40 * GIB, reserved=44 * GIB, batch=8):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": batch * 2048 / step_s, "mfu": 0.4, "step_time_s": step_s,
             "peak_mem_bytes": peak, "peak_reserved_bytes": reserved, "global_batch_size": batch}
            for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


PLAN = {"strategy": "ddp", "step_s": 0.4, "mfu": 0.4, "total_bytes": 50 * GIB, "fits": True,
        "param_bytes": 5 * GIB, "grad_bytes": 5 * GIB, "optimizer_bytes": 10 * GIB, "activation_bytes": 18 * GIB,
        "buffer_bytes": 2 * GIB, "overhead_bytes": 4 * GIB}


def test_a_speed_row_reports_the_planner_beside_the_measured_figures(tmp_path):
    """Measured / planned step time and memory (reserved peak) on the row's line, and all
    of it in the row's speed.json, with the planner's constants of the source."""
    row = Row("speed/ddp", [], exited_ok, run_dir=tmp_path / "speed_ddp")
    _metrics(row.run_dir)
    line = gs.speed_report(row, gs.Speed(8, 139.8, {"ddp": PLAN}), "ddp")
    assert line.startswith("32,768 tokens/s, MFU 40.0%, step 0.500 s, micro-batch 8, peak 40.0 GiB, reserved 44.0 GiB, "
                           "planned 50.0 GiB (5 steps)")
    assert line.endswith("; planner: step 0.400 s (measured/planned 1.25), 50.0 GiB (measured/planned 0.88)")
    saved = json.loads((row.run_dir / "speed.json").read_text())
    assert saved["row"] == "speed/ddp" and saved["plan"] == PLAN and saved["measured"]["step_s"] == 0.5
    assert saved["assumed"] == cal.planner_constants()


def test_a_given_micro_batch_is_planned_once_for_the_reports(monkeypatch):
    """``--speed-batch N``: no choice was planned; the first report asks the planner at N."""
    calls = []
    monkeypatch.setattr(gs, "plan_speed", lambda mb, gpu: calls.append((mb, gpu)) or {"ddp": PLAN, "fsdp": {}})
    fast = gs.Speed(16, 139.8)
    assert fast.plan("ddp") == PLAN and fast.plan("fsdp") == {} and calls == [(16, 139.8)]
    assert gs.Speed(16, None).plan("ddp") is None  # no GPU size: nothing to plan for


def test_the_loss_rows_run_the_speed_tokens_at_both_vocabularies(tmp_path):
    rows = {r.name: r for r in gs.rows(tmp_path, gs.Speed(8, 139.8))}
    assert list(rows)[-2:] == ["speed/loss_128k", "speed/loss_152k"]  # after the rows the goals read
    for name, vocab in (("loss_128k", 128256), ("loss_152k", 151936)):
        argv = rows[f"speed/{name}"].argv
        assert argv[argv.index("--vocab") + 1] == str(vocab) and argv[argv.index("--tokens") + 1] == str(8 * 2048)
        assert argv[argv.index("--dim") + 1] == "2048" and "--gpu" in argv and not rows[f"speed/{name}"].launch
    titan = rows["speed/torchtitan"].argv
    assert titan[titan.index("--seq-len") + 1] == "2048" and titan[titan.index("--batch") + 1] == "8"


def test_the_loss_row_reports_every_variant_and_its_share_of_the_step(tmp_path):
    row = Row("speed/loss_128k", [], exited_ok, run_dir=tmp_path / "speed_loss_128k")
    row.run_dir.mkdir()
    variants = {"whole": (40.0, 12.5), "whole+compile": (30.0, 6.0), "chunked": (45.0, 2.5),
                "chunked+compile": (35.0, 2.0)}
    (row.run_dir / "loss.json").write_text(json.dumps(
        {"vocab": 128256, "tokens": 16384, "outside_allocator_bytes": 1.5 * GIB,
         "variants": {n: {"ms": ms, "peak_bytes": gib * GIB, "loss": 11.8} for n, (ms, gib) in variants.items()}}))
    line = gs.loss_report(row)
    assert line == ("128,256 x 16,384: whole 40.0 ms 12.5 GiB, whole+compile 30.0 ms 6.0 GiB, chunked 45.0 ms 2.5 GiB, "
                    "chunked+compile 35.0 ms 2.0 GiB; outside the allocator 1.50 GiB")
    _metrics(tmp_path / "speed_ddp_compile", step_s=0.35)
    assert gs.loss_report(row).endswith("; of ddp+compile's step: whole+compile 8.6%, chunked+compile 10.0%")


def test_the_loss_script_dry_runs_the_four_variants_on_the_cpu(tmp_path, capsys):
    """bench/chunked_loss.py --gpu --dry: the GPU row's code at a tiny size, its losses equal."""
    import chunked_loss  # bench/ (the script's own directory) is on its path when run
    import train.loss

    compiled = train.loss.compiled_cross_entropy_sum
    args = argparse.Namespace(vocab=128256, tokens=16384, dim=2048, chunk=1024, iters=5, warmup=2, dry=True,
                              json=str(tmp_path / "loss.json"))
    assert chunked_loss.gpu_losses(args) == 0
    assert train.loss.compiled_cross_entropy_sum is compiled  # the eager backend for the dry run only
    got = json.loads((tmp_path / "loss.json").read_text())
    assert list(got["variants"]) == ["whole", "whole+compile", "chunked", "chunked+compile"]
    assert (got["vocab"], got["tokens"], got["chunk"], got["outside_allocator_bytes"]) == (512, 256, 64, None)
    losses = [v["loss"] for v in got["variants"].values()]
    assert max(losses) - min(losses) < 1e-3 * losses[0]
    assert "chunked+compile" in capsys.readouterr().out


def _synthetic(scratch, table=None):
    """A gpu-check scratch as the speed and loss rows leave it (the speed rows at world 1:
    the planner's step is its compute, its MFU the assumed 0.40)."""
    assumed = {"MFU": 0.40, "CUDA_OVERHEAD": 2.0e9, "FRAGMENTATION": 0.05}
    for name, step, peak, reserved in (("ddp", 0.36, 40, 42), ("zero2", 0.37, 38, 41), ("ddp+compile", 0.32, 36, 37),
                                       ("fsdp+compile", 0.33, 35, 36)):
        run_dir = gs.speed_dir(scratch, name)
        run_dir.mkdir(parents=True)
        (run_dir / "speed.json").write_text(json.dumps(
            {"row": f"speed/{name}", "strategy": name.split("+")[0], "assumed": assumed, "plan": PLAN,
             "measured": {"step_s": step, "peak_bytes": peak * GIB, "peak_reserved_bytes": reserved * GIB}}))
    for name, outside in (("loss_128k", 1.23e9), ("loss_152k", 1.31e9)):
        (gs.speed_dir(scratch, name)).mkdir()
        (gs.speed_dir(scratch, name) / "loss.json").write_text(json.dumps({"outside_allocator_bytes": outside}))


def test_calibration_names_the_constants_and_their_rows(tmp_path, capsys):
    """MFU from the eager rows (planned / measured step x 0.40: 0.444, 0.432 -> median
    0.438, rounded down), the compiled rows beside; FRAGMENTATION the largest reserved /
    allocated - 1 (zero2: 41/38 - 1 = 0.079 -> 0.08); CUDA_OVERHEAD the loss rows' largest
    memory outside the allocator, rounded up (1.4e9); a row that failed is left out."""
    _synthetic(tmp_path)
    table = tmp_path / "gpu_check.jsonl"
    table.write_text("".join(json.dumps({"row": r, "result": "FAIL" if r == "speed/loss_152k" else "pass"}) + "\n"
                             for r in ("speed/ddp", "speed/zero2", "speed/ddp+compile", "speed/fsdp+compile",
                                       "speed/loss_128k", "speed/loss_152k")))
    assert cal.main([str(tmp_path), "--table", str(table), "--json", str(tmp_path / "cal.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    now = cal.planner_constants()
    assert out[0] == (f"launcher/plan/costmodel.py: MFU = 0.43  # now {now['MFU']:.2f}; median of the eager rows "
                      "(planned / measured step x the MFU assumed): speed/ddp 0.444, speed/zero2 0.432; beside: "
                      "speed/ddp+compile 0.500, speed/fsdp+compile 0.485")
    assert out[1].startswith("launcher/plan/memory.py: FRAGMENTATION = 0.08  # now")
    assert "speed/zero2 0.079" in out[1]
    assert out[2].startswith("launcher/plan/memory.py: CUDA_OVERHEAD = 1.3e+09  # now")  # 1.23e9 up to 0.1 GB
    assert "speed/loss_128k 1.23 GB" in out[2] and "loss_152k" not in out[2]
    assert out[3].startswith("planned states + activations + buffers / allocated peak") and "speed/ddp 1.00" in out[3]
    saved = json.loads((tmp_path / "cal.json").read_text())
    assert saved["constants"]["MFU"]["value"] == 0.43 and saved["constants"]["CUDA_OVERHEAD"]["value"] == 1.3e9
    assert cal.main([str(tmp_path / "nothing")]) == 1


def test_the_constants_are_read_from_the_planner_source():
    from launcher.plan.costmodel import MFU
    from launcher.plan.memory import CUDA_OVERHEAD, FRAGMENTATION

    assert cal.planner_constants() == {"MFU": MFU, "CUDA_OVERHEAD": CUDA_OVERHEAD, "FRAGMENTATION": FRAGMENTATION}


def test_torchtitan_dry_says_whether_it_parsed_and_stubs_only_what_is_absent(monkeypatch):
    """Without torchtitan the dry row says its command line was not parsed; with it,
    torchtitan's ConfigManager parses it (on the GPU machine, whose wheels carry it). The
    MoE kernels' stand-in only where triton is absent (torch's CPU build)."""
    import importlib.util

    from bench import torchtitan_speed as tt

    args = tt.parse_args(["--compile", "--batch", "8"])
    if importlib.util.find_spec("torchtitan") is None:
        assert tt.parsed_by_torchtitan(args, tt.titan_argv(args, "/tmp/x")) == "not parsed: torchtitan is not installed here"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.delitem(sys.modules, "torchtitan.models.moe.kernels", raising=False)
    assert tt.stub_moe_kernels() is True
    with pytest.raises(RuntimeError, match="triton is not installed"):
        sys.modules["torchtitan.models.moe.kernels"].generate_permute_indices()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    assert tt.stub_moe_kernels() is False
