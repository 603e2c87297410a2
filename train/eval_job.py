"""``python -m train.eval_job RUN_DIR STEP [--failed CODE]``: one evaluation job's work
(launcher/evaljobs.py submits it; spec/evals.py says which files mean what).

1. Claim step STEP (``evals/step_N/claim``, by ``mkdir``): a second job for the same step
   (submitted twice across a requeue) ends here, so a step is evaluated once. STEP 0: the
   run's newest committed checkpoint (a chain's ``eval`` step).
2. Export the checkpoint as a Hugging Face directory (``evals/step_N/hf``, the run's
   tokenizer with it; a LoRA run's adapters merged into their base), then mark it read (``read``): ``checkpoint.keep`` may prune it now.
3. The validation loss, when the run's data has a validation split: our model, loaded from
   the checkpoint, over the same ``train.eval_batches`` global batches as the trainer's
   ``train.eval_every`` (each data-parallel rank's share in turn, their mean as the ranks
   agree on it), so the figure equals the trainer's at that step.
4. lm-eval's tasks on the export (``eval.tasks``: names, or YAML files whose directories
   go on its include path), offline.
5. The rows in ``RUN_DIR/eval.jsonl`` (spec.evals.FIELDS), TensorBoard scalars
   ``eval/TASK/METRIC`` on the run's step axis (``tracking.tensorboard``), a W&B run of
   its own (``tracking.wandb``: scalars against ``train_step``), and
   ``result.json``; the export is removed. ``--failed CODE`` (the batch script, after a
   non-zero exit or its own timeout) records the failure, unless a result exists.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from spec import evals
from spec.config import RunConfig, to_run_config
from spec.peft import lora_enabled
from spec.rundir import CHECKPOINTS, CONFIG, TENSORBOARD


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.eval_job", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("step", type=int, help="the checkpoint's step; 0: the newest committed one")
    p.add_argument("--failed", type=int, default=None, help="record the evaluation as failed (exit status)")
    p.add_argument("--config", type=Path, default=None, help="the config to take eval.* from (launcher.eval's overrides)")
    p.add_argument("--hf", type=Path, default=None, help="a whole Hugging Face model directory to evaluate instead")
    return p.parse_args(argv)


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID", "")


def checkpoint_of(run_dir: Path, step: int) -> Optional[Path]:
    from train.checkpoint.manifest import find_latest, step_name

    if step == 0:
        return find_latest(run_dir / CHECKPOINTS, report=lambda msg: print(msg, file=sys.stderr))
    ckpt = run_dir / CHECKPOINTS / step_name(step)
    return ckpt if (ckpt / "COMMITTED").is_file() else None


def tokens_at(run_dir: Path, step: int) -> int:
    queued = evals.read_json(evals.step_dir(run_dir, step) / "job.json") or {}
    return int(queued.get("tokens", 0))


def append_rows(run_dir: Path, rows: List[Dict[str, Any]]) -> None:
    """Append whole lines under an exclusive lock (several evaluations may end together)."""
    with open(run_dir / evals.ROWS, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("".join(json.dumps({k: r.get(k) for k in evals.FIELDS}) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def validation_loss(cfg: RunConfig, hf: Path, device: str) -> Optional[float]:
    """The trainer's validation loss of the exported weights (fp32: the checkpoint's own),
    None without a validation split. Read from the export, not the checkpoint: once the
    export is written the checkpoint may be pruned."""
    import contextlib

    import torch

    from spec.layout import build_layout
    from train.data import build_loader
    from train.model import build_model, materialise
    from train.strategies.base import forward_loss

    dp = build_layout(cfg).dp
    try:
        loaders = [build_loader(cfg, r, dp, split="val") for r in range(dp)]
    except (ValueError, FileNotFoundError):
        return None
    model = build_model(cfg.model, "meta")
    materialise([model], cfg.train.seed, torch.device(device), hf_path=str(hf))
    model.eval()
    bf16 = device.startswith("cuda") and cfg.strategy.mixed_precision != "fp32"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    total = 0.0
    for loader in loaders:  # each data-parallel rank's share, as the trainer's ranks computed them
        mine = torch.zeros((), dtype=torch.float64)
        for k in range(cfg.train.eval_batches):
            loader.load_state_dict({"step": k})
            batches = loader.next_step()
            share = loader.step_targets / loader.dp_size
            mine += forward_loss(model, batches, torch.device(device), autocast, share).double().cpu()
        total += float(mine / cfg.train.eval_batches)
    return total / dp


def task_names(tasks: List[str]) -> tuple:
    """(lm-eval task names, directories for its include path): a YAML file's task is its
    ``task:`` line (read as text: lm-eval's YAMLs may hold ``!function`` tags)."""
    names, dirs = [], []
    for t in tasks:
        if t.endswith((".yaml", ".yml")):
            found = re.search(r"^task:\s*['\"]?([^'\"\s#]+)", Path(t).read_text(), re.M)
            if not found:
                raise ValueError(f"eval.tasks: {t} has no 'task:' line")
            names.append(found.group(1))
            dirs.append(str(Path(t).resolve().parent))
        else:
            names.append(t)
    return names, sorted(set(dirs))


def lm_eval_rows(cfg: RunConfig, hf: Path, device: str) -> List[Dict[str, Any]]:
    """(task, metric, value, stderr) of lm-eval's results on the exported model."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    names, dirs = task_names(list(cfg.eval.tasks))
    dtype = "bfloat16" if device.startswith("cuda") and cfg.strategy.mixed_precision != "fp32" else "float32"
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf), "dtype": dtype, "device": device},
                                  tasks=names, task_manager=TaskManager(include_path=dirs or None),
                                  limit=cfg.eval.limit, batch_size=cfg.eval.batch_size, log_samples=False)
    rows = []
    for task, metrics in sorted(out["results"].items()):
        for key, value in sorted(metrics.items()):
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append({"task": task, "metric": metric, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None})
    return rows


def scalars(cfg: RunConfig, run_dir: Path, step: int, rows: List[Dict[str, Any]]) -> None:
    """TensorBoard's ``eval/TASK/METRIC`` at the run's step (a writer of its own, beside the
    trainer's); W&B: a run of its own per evaluation (job_type ``eval``, grouped by the
    training run's id, which another process may be writing), its scalars against ``train_step``."""
    if cfg.tracking.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=str(run_dir / TENSORBOARD / "eval"), filename_suffix=f".step{step}") as tb:
            for r in rows:
                tb.add_scalar(f"eval/{r['task']}/{r['metric']}", r["value"], step)
    w = cfg.tracking.wandb
    if w.project and w.mode != "disabled":
        import wandb

        from train.tracking import run_id

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, id=f"{run_id(run_dir)}-eval-{step}",
                         dir=str(run_dir), group=run_id(run_dir), job_type="eval", name=f"{run_dir.name} eval {step}",
                         tags=list(w.tags) or None, config={"run_id": run_id(run_dir), "step": step}, resume="allow")
        run.define_metric("eval/*", step_metric="train_step")
        run.log({"train_step": step, **{f"eval/{r['task']}/{r['metric']}": r["value"] for r in rows}})
        run.finish()


def evaluate(cfg: RunConfig, run_dir: Path, step: int, ckpt: Path) -> List[Dict[str, Any]]:
    from train.hf_io import export

    d = evals.step_dir(run_dir, step)
    dev = eval_device()
    tokenizer, eos, bos = evals.tokenizer(cfg)
    if not (d / "read").exists():  # a requeued attempt finds the export of the first
        shutil.rmtree(d / "hf", ignore_errors=True)
        source = None
        if lora_enabled(cfg):  # the adapters merged into their base: a whole model for lm-eval
            from train.lora_io import merged_source

            source = merged_source(ckpt, cfg)
        export(ckpt, cfg.model, d / "hf", tokenizer=tokenizer, eos_token_id=eos, bos_token_id=bos, source=source)
        (d / "read").touch()  # the checkpoint may be pruned now: what follows reads the export
        from train.checkpoint.manager import prune

        prune(run_dir / CHECKPOINTS, cfg.checkpoint.keep)  # those the training kept for evaluations
    rows = []
    val = validation_loss(cfg, d / "hf", dev)
    if val is not None:
        rows.append({"task": "val", "metric": "loss", "value": val, "stderr": None})
    rows += lm_eval_rows(cfg, d / "hf", dev)
    shutil.rmtree(d / "hf", ignore_errors=True)
    return rows


def eval_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def claim(d: Path) -> bool:
    """Take the step for this job (``mkdir``: one winner), or find it taken by this same
    job before a requeue; False: another job has it."""
    try:
        (d / "claim").mkdir()
    except FileExistsError:
        try:
            holder = (d / "claim" / "job").read_text().strip()
        except OSError:
            return False
        return bool(job_id()) and holder == job_id() and not (d / "result.json").exists()
    (d / "claim" / "job").write_text(job_id() + "\n")
    return True


def record_failure(run_dir: Path, step: int, code: int) -> int:
    d = evals.step_dir(run_dir, step)
    if not (d / "result.json").exists():
        why = "its time limit" if code == 124 else f"exit status {code}"
        evals.write_json(d / "result.json", {"outcome": "failed", "job_id": job_id(), "error": why})
    shutil.rmtree(d / "hf", ignore_errors=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    run_dir = args.run_dir.resolve()
    cfg = to_run_config(args.config or run_dir / CONFIG)
    ckpt = checkpoint_of(run_dir, args.step) if args.hf is None else args.hf
    step = int(ckpt.name[len("step_"):]) if ckpt is not None and args.hf is None else args.step
    if args.failed is not None:
        return record_failure(run_dir, step, args.failed)
    d = evals.step_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    if not claim(d):
        print(f"step {step} of {run_dir} is evaluated by another job already: nothing to do", file=sys.stderr)
        return 0
    if ckpt is None and not (d / "read").exists():
        evals.write_json(d / "result.json", {"outcome": "failed", "job_id": job_id(),
                                             "error": f"no committed checkpoint of step {step}"})
        print(f"error: {run_dir} has no committed checkpoint of step {step}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        rows = lm_eval_rows(cfg, args.hf, eval_device()) if args.hf is not None else evaluate(cfg, run_dir, step, ckpt)
    except Exception as exc:  # recorded; the training never depends on it
        evals.write_json(d / "result.json", {"outcome": "failed", "job_id": job_id(), "error": repr(exc)[:500]})
        raise
    seconds = round(time.monotonic() - t0, 3)
    tokens = tokens_at(run_dir, step)
    full = [{**r, "step": step, "tokens": tokens, "job_id": job_id(), "seconds": seconds} for r in rows]
    if not any(r["step"] == step and r["job_id"] == job_id() for r in evals.rows(run_dir)):  # not a requeue's repeat
        append_rows(run_dir, full)
    scalars(cfg, run_dir, step, full)
    evals.write_json(d / "result.json", {"outcome": "ok", "job_id": job_id(), "seconds": seconds, "rows": len(full)})
    print(f"evaluated step {step} of {run_dir}: {len(full)} row(s) in {seconds} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
