"""Evaluation jobs' files in the run directory (pure: no torch, no Slurm).

One evaluation a chosen checkpoint (``eval.on_checkpoint``), each a Slurm job of its own
(docs/experiments.md). Who does what, through these files only:

- the trainer's rank 0, once a checkpoint of step N is committed and N is chosen
  (:func:`chosen`), writes ``RUN_DIR/evals/queue/N.json`` (:func:`enqueue`), unless step N
  is queued or submitted already (a preemption's save of the same step, a restart);
- the batch script's step loop (``slurm/step_loop.sh``: it has Slurm's client, the tasks
  may not, in a container) sees a file in ``queue/`` within a second and runs
  ``launcher.evaljobs submit RUN_DIR``: sbatch, then ``evals/step_N/job.json``, then the
  queue file goes. Killed between the two, the next loop submits N again, and the second
  job finds N claimed and ends (exactly one evaluation a step);
- the evaluation job claims N (``step_N/claim``, made by ``mkdir``: atomic), exports the
  checkpoint, writes ``step_N/read`` (the checkpoint may be pruned from then on), evaluates,
  appends its rows to ``RUN_DIR/eval.jsonl`` and writes ``step_N/result.json``.

``checkpoint.keep`` never prunes a checkpoint that is queued or submitted and not yet read
(:func:`pinned`); a failed evaluation (result ``failed``) unpins it as well.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from spec.data import tokenizer_of

EVALS = "evals"
ROWS = "eval.jsonl"
QUEUE = "queue"
#: eval.jsonl's fields, in order (a row per step, task and metric): a contract.
FIELDS = ("step", "tokens", "task", "metric", "value", "stderr", "job_id", "seconds")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / EVALS / f"step_{int(step):08d}"


def queue_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / EVALS / QUEUE / f"{int(step)}.json"


def chosen(every_steps: int, step: int, last: int) -> bool:
    """Whether the checkpoint of ``step`` is evaluated: a multiple of ``every_steps`` (0:
    every committed one), or the run's ``last`` step."""
    return every_steps <= 0 or step % every_steps == 0 or step == last


def write_json(path: Path, obj: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True) + "\n")
    os.replace(tmp, path)


def enqueue(run_dir: Path, step: int, tokens: int, checkpoint: str) -> bool:
    """Queue step ``step`` once (False: queued or submitted already)."""
    if queue_file(run_dir, step).exists() or step_dir(run_dir, step).exists():
        return False
    write_json(queue_file(run_dir, step), {"step": int(step), "tokens": int(tokens), "checkpoint": checkpoint})
    return True


def queued(run_dir: Path) -> List[Dict[str, Any]]:
    """The queue's entries, oldest step first."""
    out = []
    for f in (Path(run_dir) / EVALS / QUEUE).glob("*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: e["step"])


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pinned(run_dir: Path, step: int) -> bool:
    """Whether pruning must keep the checkpoint of ``step``: its evaluation has not read it."""
    d = step_dir(run_dir, step)
    if queue_file(run_dir, step).exists():
        return True
    return d.is_dir() and not (d / "read").exists() and not (d / "result.json").exists()


def submitted(run_dir: Path) -> List[Dict[str, Any]]:
    """Every submitted evaluation: its step, job id and result (None while it runs)."""
    out = []
    for d in sorted((Path(run_dir) / EVALS).glob("step_*")):
        job = read_json(d / "job.json")
        if job is None:
            continue
        out.append({**job, "result": read_json(d / "result.json")})
    return out


def rows(run_dir: Path) -> List[Dict[str, Any]]:
    """eval.jsonl's rows (a torn last line, from a job killed while writing, is skipped)."""
    f = Path(run_dir) / ROWS
    out = []
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def newest_scores(run_dir: Path) -> Dict[str, Any]:
    """{"step": newest evaluated step, "scores": {task/metric: value}} (empty without rows)."""
    all_rows = rows(run_dir)
    if not all_rows:
        return {}
    step = max(r["step"] for r in all_rows)
    return {"step": step, "scores": {f"{r['task']}/{r['metric']}": r["value"] for r in all_rows if r["step"] == step}}


def every(eval_every: Optional[int], checkpoint_every: Optional[int]) -> int:
    """``eval.every_steps`` resolved: null takes the periodic saves' interval (0 without one)."""
    return eval_every if eval_every is not None else (checkpoint_every or 0)


def enqueuer(every_steps: int, last: Callable[[], int], run_dir: Path, tokens_per_step: int):
    """The Checkpointer's ``on_commit`` (rank 0): queue each chosen committed step once.
    ``last()``: the run's last step as the schedule resolved it (train.epochs sets it at start)."""
    def on_commit(step: int) -> None:
        if chosen(every_steps, step, last()):
            enqueue(run_dir, step, step * tokens_per_step, f"step_{int(step):08d}")
    return on_commit


def tokenizer(cfg) -> tuple:
    """(tokenizer, EOS id, BOS id) an evaluation exports with the model: the prepared data's
    (spec.data.tokenizer_of), else model.hf_path's directory when it holds tokenizer.json;
    (None, None, None) when the run has none (lm-eval cannot run: launcher/evaljobs.py refuses)."""
    found, eos, bos = tokenizer_of(cfg)
    if found is not None and found.is_file():
        return found, eos, bos
    if cfg.model.hf_path and (Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        return Path(cfg.model.hf_path), eos, bos
    return None, None, None
