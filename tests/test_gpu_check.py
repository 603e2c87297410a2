"""`make gpu-check` cannot rot on machines without a GPU: its dry mode builds every row's
command and checks it (the launcher's own dry run: compose, layout, memory gate; the
check rows' CPU-checkable parts), and the real mode refuses at once without CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import warm

from conftest import REPO

ROWS = {"health", "binding/task", "binding/node", "binding/agent", "hf/zero3", "hf/zero3:write", "accelerate/zero2", "profile/memory",
        "train/packed", "train/packed:data", "packed/equal",
        "accelerate/fsdp", "doctor", "resume/fsdp", "resume/fsdp:crash", "resume/zero2", "resume/zero2:crash",
        *(f"engine/{s}" for s in ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "tp", "pp",
                                  "ddp+compile")), "parity/bf16",
        *(f"speed/{s}" for s in ("ddp", "ddp+compile", "fsdp+compile", "zero2", "torchtitan"))}
ROWS |= {f"bigjob/{s}" for s in ("rank", "snapshot", "save_load", "affinity")}  # bench/gpu_check_bigjob.py's rows
ROWS |= {f"float8/{s}{b}" for s in ("1b", "8b_block") for b in ("", ":bf16")}  # bench/gpu_check_float8.py's rows
ROWS |= {"speed/loss_128k", "speed/loss_152k"}  # bench/gpu_check_speed.py's rows beyond the speed runs


def _gpu_check(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench/gpu_check.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _warm_modules(monkeypatch):
    """bench.gpu_check with its ``python -m ...`` commands (the launcher's dry runs, the
    planner) forked from the warm server (tests/warm.py: the code without an interpreter's
    start and imports each, ~1.5 CPU-s a command); the others as the script runs them."""
    sys.path.insert(0, str(REPO))
    import bench.gpu_check as gpu_check
    import bench.gpu_check_runner as runner

    plain = runner.execute

    def execute(row, deadline):
        if row.argv[1:2] == ["-m"]:
            return warm.run_module(row.argv[2], row.argv[3:], cwd=REPO, env=row.env,
                                   timeout=max(1.0, deadline - time.time()))
        return plain(row, deadline)

    monkeypatch.setattr(runner, "execute", execute)
    return gpu_check


def test_dry_mode_checks_every_row(tmp_path, monkeypatch, capsys):
    """``--dry`` over every row, in-process (launcher rows forked warm: _warm_modules). The
    script's own start is run by the tests below. The speed rows and torchtitan's take the
    micro-batch the planner fits on an H100 (79.2 GiB), whole logits: 4."""
    gpu_check = _warm_modules(monkeypatch)
    assert gpu_check.main(["--dry", "--out", str(tmp_path / "out"), "--scratch", str(tmp_path / "scratch")]) == 0
    assert "speed rows: micro-batch 4 (the largest of 16, 8, 4 the planner fits on 79.2 GB" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    assert {r["row"] for r in rows} == ROWS
    assert all(r["result"] == "dry" for r in rows), [r for r in rows if r["result"] != "dry"]
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert table.startswith("| row | result |") and table.count("\n| ") == len(ROWS)  # one line a row


def test_without_cuda_it_refuses_at_once(tmp_path):
    proc = _gpu_check("--out", str(tmp_path / "out"), "--only", "engine/ddp", cwd=tmp_path)
    assert proc.returncode == 2 and "no CUDA here" in proc.stdout, proc.stdout + proc.stderr


def test_an_unknown_row_is_named(tmp_path):
    proc = _gpu_check("--dry", "--only", "engine/nope", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "no such row" in proc.stdout and "engine/ddp" in proc.stdout


def test_speed_row_reports_the_steady_steps(tmp_path):
    """A speed row's figures are the medians of the steps after the fifth (warm-up and compile
    left out) and the busiest peak over them, read from the run's metrics.jsonl."""
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import Row, exited_ok, speed

    rows = [{"step": s, "loss": 1.0, "tokens_per_s": 10.0 if s <= 5 else 1000.0 + s, "mfu": 0.01 if s <= 5 else 0.3,
             "step_time_s": 0.5, "peak_mem_bytes": (s % 3) * 2**30} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert speed(Row("speed/x", [], exited_ok, run_dir=tmp_path)) == \
        "1,008 tokens/s, MFU 30.0%, step 0.500 s, peak 2.0 GiB (5 steps)"
    for r in rows:  # the step's parts (train/steptimes.py), the slowest rank's, when the rows have them
        r.update({name: {"min": 0.0, "median": 0.0, "max": ms / 1000, "max_rank": 0}
                  for name, ms in (("data_s", 2), ("fwd_bwd_s", 400), ("optim_s", 90))})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert speed(Row("speed/x", [], exited_ok, run_dir=tmp_path)).endswith(
        "(5 steps); ms: data 2.0, fwd_bwd 400.0, optim 90.0")
    for r in rows:  # the allocator's reserved peak, the batch, and the planner's figure beside them
        r.update(peak_reserved_bytes=3 * 2**30, global_batch_size=8)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "micro-batch 8, peak 2.0 GiB, reserved 3.0 GiB, planned 4.5 GiB (5 steps)" in \
        speed(Row("speed/x", [], exited_ok, run_dir=tmp_path), planned=4.5 * 2**30)


def test_a_resume_row_brings_the_engine_row_it_is_compared_with(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import rows, select

    every = rows(tmp_path)
    assert [r.name for r in select(every, ["resume/zero2"])] == ["engine/zero2", "resume/zero2"]
    assert [r.name for r in select(every, ["binding"])] == ["binding/task", "binding/node", "binding/agent"]
    assert len(select(every, None)) == len(every)


def test_rows_sharing_the_gpu_keep_their_order_and_the_speed_rows_run_alone_last(tmp_path):
    """``--jobs``: a resume row runs after its engine row (it reads that run), the other small
    rows at once, and the speed rows one by one after every small row has ended."""
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import Row, Table, exited_ok, run_rows

    log = tmp_path / "log"

    def row(name: str, nap: float) -> Row:
        code = f"import time; time.sleep({nap}); open({str(log)!r}, 'a').write({name!r} + '\\n')"
        return Row(name, [sys.executable, "-c", code], exited_ok, launch=False)

    selected = [row("engine/zero2", 0.6), row("engine/ddp", 0.0), row("resume/zero2", 0.0), row("speed/a", 0.2),
                row("speed/b", 0.0), row("doctor", 0.3)]
    assert run_rows(selected, Table(tmp_path / "out"), budget_s=60, jobs=4) == 0
    order = log.read_text().split()
    assert order.index("engine/zero2") < order.index("resume/zero2")
    assert order.index("engine/ddp") < order.index("engine/zero2")  # did not wait for it
    assert order[-2:] == ["speed/a", "speed/b"]


def test_the_torchtitan_row_reports_ddp_compile_over_torchtitan(tmp_path):
    """speed/torchtitan's line: torchtitan's tokens/s and MFU (bench/torchtitan_speed.py's
    JSON) and the median tokens/s of speed/ddp+compile's steps after the fifth over it."""
    sys.path.insert(0, str(REPO))
    import bench.gpu_check as gpu_check

    row = next(r for r in gpu_check.rows(tmp_path) if r.name == "speed/torchtitan")
    assert "--compile" in row.argv and not row.launch
    row.run_dir.mkdir(parents=True)
    (row.run_dir / "torchtitan.json").write_text(json.dumps(
        {"torchtitan": "0.2.2", "tokens_per_s": 50000.0, "mfu": 0.4156, "step_s": 0.164, "peak_reserved_gib": 41.2}))
    alone = gpu_check.beside_torchtitan(row)
    assert alone == "torchtitan 0.2.2: 50,000 tokens/s, MFU 41.6%, step 0.164 s, peak reserved 41.2 GiB"
    ours = tmp_path / "speed_ddp_compile"
    ours.mkdir()
    rows = [{"step": k, "tokens_per_s": 1000.0 if k <= 5 else 52000.0 + k} for k in range(1, 11)]
    (ours / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_check.beside_torchtitan(row) == alone + "; ddp+compile / torchtitan 1.040"  # median 52008


def test_the_parity_row_compares_every_engine_row_with_ddp(tmp_path, capsys):
    """parity/bf16 reads the engine rows' metrics: within 2% of engine/ddp at every step it
    passes and reports each engine's worst difference; one engine beyond it, or with other
    steps, fails the row, naming it."""
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import ENGINES, Row, engine_dir, exited_ok, parity
    from bench.gpu_check_rows import parity as parity_row

    def write(name, losses):
        engine_dir(tmp_path, name).mkdir(parents=True, exist_ok=True)
        (engine_dir(tmp_path, name) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s + 1, "loss": v}) + "\n" for s, v in enumerate(losses)))

    for name in ENGINES:
        write(name, [6.0, 5.5, 5.0] if name != "zero3" else [6.0, 5.5, 5.05])  # zero3 1% off at step 3
    assert parity_row(tmp_path, dry=False) == 0
    report = parity(Row("parity/bf16", [], exited_ok, run_dir=tmp_path))
    assert "zero3 1.00%" in report and "ddp+compile 0.00%" in report and "ddp " not in report.replace("ddp+", "")
    write("ddp+compile", [6.0, 5.5, 5.2])  # 4% off
    write("pp", [6.0, 5.5])
    assert parity_row(tmp_path, dry=False) == 1
    out = capsys.readouterr().out
    assert "not the same maths: pp: steps [1, 2] vs ddp's [1, 2, 3]; ddp+compile 4.00% > 2%" in out


def test_the_speed_rows_take_the_largest_micro_batch_the_planner_fits(tmp_path, monkeypatch):
    """An H200's 139.8 GiB fits micro-batch 8 with whole logits (16 does not), 200 GB 16: the
    speed rows and torchtitan's row run it, with the GPU's memory for the launcher's gate."""
    gpu_check = _warm_modules(monkeypatch)
    h200, big = gpu_check.speed_batch(139.8), gpu_check.speed_batch(200.0)
    assert (h200.micro_batch, big.micro_batch) == (8, 16)
    assert set(h200.planned) == {"ddp", "fsdp", "zero2"} and all(b < 139.8 * 2**30 for b in h200.planned.values())
    rows = {r.name: r for r in gpu_check.rows(tmp_path, h200)}
    assert {"train.micro_batch_size=8", "cluster.gpu_mem_gb=139.8", "model.loss_chunk_tokens=0"} <= \
        set(rows["speed/fsdp+compile"].argv)
    titan = rows["speed/torchtitan"].argv
    assert titan[titan.index("--batch") + 1] == "8"
