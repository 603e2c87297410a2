"""metrics.jsonl rows for a user's Hugging Face ``Trainer`` (TRL's trainers included).

A script run with ``entrypoint=script.py`` that trains with ``transformers.Trainer`` or
one of its subclasses (TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ...) logs
through the Trainer's callbacks, not through :func:`train.session.log`; unchanged, it
would leave ``metrics.jsonl`` empty and ``launcher.status``, the summary and the reports
blind. :func:`install` (called by :mod:`train.harness.user` before the code runs, in the
task's own process) watches for the import of ``transformers.trainer`` and then wraps
``Trainer.__init__`` so that every Trainer made gets a ``MetricsCallback``
(transformers is imported only if the code imports it). Each training log (every
``logging_steps``) becomes one row through :func:`train.session.log` (global rank 0
writes; the ``segment`` of the harness): ``step`` (``state.global_step``), ``loss``, ``lr``,
``grad_norm``, ``epoch``, ``val_loss`` / ``val_ppl`` of an evaluation at that step, and
over the steps since the previous row ``step_time_s``, ``samples_per_s`` and
``global_batch_size`` (the Trainer's total batch), ``tokens_per_s`` and
``tokens_per_step`` where the Trainer counts tokens (``num_input_tokens_seen`` with
``include_num_input_tokens_seen``, or TRL's ``num_tokens``); the log's other numbers
(TRL's ``mean_token_accuracy``, ``entropy``, ...) are kept as extra fields.

At the warning signal (USR2 before a time limit or a preemption) or SIGTERM, the same
callback has every rank agree at the end of a step (:func:`train.session.should_stop`),
has the Trainer save its checkpoint of that step (``control.should_save``) and ends the
script once it is written (``on_save`` raises :class:`train.harness.preempt.Preempted`: the
code after ``trainer.train()``, a final save or a push, does not run in a preempted
segment); rank 0 then records the interruption and requeues the job, as for the
built-in trainer. A requeued job's script resumes from its own last checkpoint (the
script's ``resume_from_checkpoint``): the signal's step. Steps logged after the
checkpoint a segment resumes from (a crash's) are logged again by the later segment, and
the readers keep the newest row of a step (:func:`launcher.track.scaling.stitch`).

``STO_TRAINER_METRICS=0`` in the tasks' environment leaves the Trainer alone (a script
that writes its own rows or handles the signal itself). Nothing here imports transformers or torch at module level.
"""
from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
import time
import weakref
from typing import Any, Dict, Optional

from spec.rundir import MetricsRow, perplexity
from train import session
from train.harness.preempt import Preempted

ENV = "STO_TRAINER_METRICS"
_MODULE = "transformers.trainer"
_MARK = "_sto_metrics_callback"
# Log keys a row takes under names of its own (learning_rate: lr).
_MAPPED = {"loss", "learning_rate", "grad_norm", "epoch"}
# Not a step's: the Trainer's whole-run figures (train_runtime, train_tokens_per_second, ...)
# and an evaluation's (on_evaluate takes its eval_loss).
_SESSION_PREFIXES = ("train_", "eval_", "test_")


def install() -> None:
    """Give every ``transformers.Trainer`` made in this process the metrics callback:
    now if transformers.trainer is imported already, else when it is."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    module = sys.modules.get(_MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands out the real spec of transformers.trainer with its
    loader wrapped, so the module is patched right after it executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, finder: _Finder) -> None:
        self._inner, self._finder = inner, finder

    def __getattr__(self, name: str) -> Any:  # get_source, get_data, ...: the real loader's
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _patch(module)


def _patch(module: Any) -> None:
    """Wrap ``module.Trainer.__init__`` (once): each Trainer gets a MetricsCallback. A
    failure here never fails the code's import: the Trainer runs without rows."""
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls.__init__, _MARK, False):
        return
    try:
        callback = callback_class()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(f"train.rank{session.rank()}").warning(
            f"no metrics.jsonl rows from the Trainer: {type(exc).__name__}: {exc}")
        return
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not any(isinstance(cb, TrainerRows) for cb in self.callback_handler.callbacks):
            self.add_callback(callback(self))

    setattr(__init__, _MARK, True)
    trainer_cls.__init__ = __init__


@functools.lru_cache(maxsize=None)
def callback_class() -> type:
    """``MetricsCallback``: :class:`TrainerRows` as a ``transformers.TrainerCallback``."""
    from transformers.trainer_callback import TrainerCallback

    return type("MetricsCallback", (TrainerRows, TrainerCallback), {"__module__": __name__})


class TrainerRows:
    """A Trainer's logs as metrics.jsonl rows (see the module's doc): the events of a
    ``TrainerCallback`` (:func:`callback_class` makes it one)."""

    def __init__(self, trainer: Any = None) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._since: Optional[tuple] = None  # (time, global_step, tokens by source) of the last row
        self._pending: Optional[Dict[str, Any]] = None  # a row that waits for its step's evaluation
        self._last_step = -1  # the last step this segment wrote
        self._warned = False
        self._stopping = False  # a signal was agreed: the Trainer saves at this step, then the script ends

    # -- the Trainer's events ---------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After a resume the state is the checkpoint's (its global_step, num_input_tokens_seen);
        # TRL's num_tokens counts from 0 in every process.
        self._since = (time.time(), state.global_step,
                       {"num_input_tokens_seen": state.num_input_tokens_seen or 0, "num_tokens": 0})
        self._last_step = state.global_step

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return  # an evaluation's log (on_evaluate takes it) or the summary at the end
        self._guard(self._train_log, args, state, control, logs)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Optional[Dict[str, Any]] = None,
                    **kwargs: Any) -> None:
        self._guard(self._evaluated, state, metrics or {})

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard(self._flush)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The warning signal (a time limit's or a preemption's USR2) or SIGTERM on any rank:
        # every rank agrees at this step (train.session.should_stop: one all-reduce of a
        # number a step), the Trainer saves its checkpoint now, and on_save ends the script.
        # Not guarded: a collective that fails here is the run's failure, not a metric's.
        if not self._stopping and session.should_stop():
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard(self._pause_ended, state)
        if self._stopping:  # the checkpoint of the signal's step is written: nothing after it runs
            self._guard(self._flush)
            raise Preempted(f"stopped after the Trainer's checkpoint of step {state.global_step} (a signal)")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard(self._flush)

    # -- rows --------------------------------------------------------------------------
    def _guard(self, fn: Any, *args: Any) -> None:
        """Metrics never stop the user's training: a failure is logged once."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logging.getLogger(f"train.rank{session.rank()}").warning(
                    f"metrics.jsonl rows from the Trainer's logs stopped: {type(exc).__name__}: {exc}")

    def _train_log(self, args: Any, state: Any, control: Any, logs: Dict[str, Any]) -> None:
        self._flush()
        row = self._row(args, state, logs)
        if getattr(control, "should_evaluate", False):
            self._pending = row  # its evaluation follows at this step: on_evaluate adds val_loss
        else:
            self._write(row)

    def _row(self, args: Any, state: Any, logs: Dict[str, Any]) -> Dict[str, Any]:
        now, step = time.time(), int(state.global_step)
        row: Dict[str, Any] = {"step": step, "loss": _number(logs.get("loss")),
                               "lr": _number(logs.get("learning_rate")),
                               "grad_norm": _number(logs.get("grad_norm")), "epoch": _number(logs.get("epoch"))}
        known = set(MetricsRow.names())
        row.update({k: _number(v) for k, v in logs.items()
                    if k not in known | _MAPPED and not k.startswith(_SESSION_PREFIXES)})
        tokens = {"num_input_tokens_seen": state.num_input_tokens_seen or 0,
                  "num_tokens": _number(logs.get("num_tokens")) or 0}
        if self._since is not None:
            then, step0, tokens0 = self._since
            steps, dt = step - step0, now - then
            if steps > 0 and dt > 0:
                row["step_time_s"] = dt / steps
                batch = self._global_batch(args)
                if batch:
                    row.update(global_batch_size=batch, samples_per_s=steps * batch / dt)
                for source in ("num_input_tokens_seen", "num_tokens"):  # the Trainer's own count first
                    seen = tokens[source] - tokens0[source]
                    if tokens[source] and seen > 0:
                        row.update(tokens_per_s=seen / dt, tokens_per_step=int(round(seen / steps)))
                        break
        self._since = (now, step, tokens)
        return {k: v for k, v in row.items() if v is not None}

    def _global_batch(self, args: Any) -> Optional[int]:
        trainer = self._trainer() if self._trainer is not None else None
        total = getattr(trainer, "get_total_train_batch_size", None)
        if total is not None:
            return int(total(args))
        return int(args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size)

    def _evaluated(self, state: Any, metrics: Dict[str, Any]) -> None:
        """An evaluation's loss joins its step's row; an evaluation at a step that has no
        training log gets a row of its own, unless its step has a row already (e.g.
        ``trainer.evaluate()`` after ``train()``: a second row would hide the first's loss)."""
        loss, step = _number(metrics.get("eval_loss")), int(state.global_step)
        row, self._pending = self._pending, None
        if row is not None and row["step"] != step:
            self._write(row)
            row = None
        if row is None and loss is not None and step > self._last_step:
            row = {"step": step}
        if row is not None:
            if loss is not None:
                row.update(val_loss=loss, val_ppl=perplexity(loss))
            self._write(row)
        self._pause_ended(state)

    def _pause_ended(self, state: Any) -> None:
        """An evaluation or a checkpoint after this step's row: the next row's step time
        starts now, as the built-in trainer's leave both out."""
        if self._since is not None and self._since[1] == state.global_step:
            self._since = (time.time(), *self._since[1:])

    def _flush(self) -> None:
        row, self._pending = self._pending, None
        if row is not None:
            self._write(row)

    def _write(self, row: Dict[str, Any]) -> None:
        self._last_step = max(self._last_step, row["step"])
        session.log(**row)


def _number(value: Any) -> Optional[float]:
    """A log value as a plain number (a tensor's item); None for anything else."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value
