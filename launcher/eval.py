"""``python -m launcher.eval RUN_DIR [--step N ...] [--hf DIR] [--dry-run] [eval.KEY=VALUE ...]``

Evaluates a run's committed checkpoints as ``eval.on_checkpoint`` does during training:
one Slurm job each (launcher/evaljobs.py), rows in ``RUN_DIR/eval.jsonl``. Without
``--step``: every committed checkpoint not evaluated yet. ``eval.*`` overrides (tasks,
limit, resources) apply to these jobs only; the run's config is not changed.

``--dry-run``: print the first job's batch script and the steps, submit and write nothing.

``--hf DIR``: a whole Hugging Face model directory instead, e.g. a user's Trainer or TRL
``checkpoint-N`` (its step is N): config.json with its weights. Sharded training state
alone (FSDP's ``pytorch_model_fsdp_*``, DeepSpeed's ``global_step*``) is refused: lm-eval
needs the gathered model.
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from launcher import evaljobs
from spec import evals
from spec.config import ConfigError, RunConfig, to_run_config, to_yaml
from spec.batch import global_batch
from spec.layout import build_layout
from spec.rundir import CHECKPOINTS, CONFIG, read_run_json

USAGE = "usage: python -m launcher.eval RUN_DIR [--step N ...] [--hf DIR] [--dry-run] [eval.KEY=VALUE ...]"


def parse(argv: List[str]) -> Tuple[Path, List[int], Optional[Path], List[str]]:
    run_dir, steps, hf, overrides = None, [], None, []
    args = iter(argv)
    for a in args:
        if a == "--dry-run":
            continue
        if a in ("--step", "--hf"):
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{a} needs a value; {USAGE}")
            if a == "--hf":
                hf = Path(value).resolve()
            elif value.isdigit() and int(value) > 0:
                steps.append(int(value))
            else:
                raise ConfigError(f"--step {value}: not a step (a positive integer); {USAGE}")
        elif run_dir is None and not a.startswith("-"):  # first: a run directory's name may hold '='
            run_dir = Path(a).resolve()
        elif "=" in a:
            if not a.startswith("eval."):
                raise ConfigError(f"{a}: only eval.* settings apply to an evaluation; {USAGE}")
            overrides.append(a)
        else:
            raise ConfigError(f"{a}: unknown argument; {USAGE}")
    if run_dir is None or not (run_dir / CONFIG).is_file():
        raise ConfigError(f"RUN_DIR={run_dir}: not a run directory (no {CONFIG}); {USAGE}")
    return run_dir, steps, hf, overrides


def with_overrides(run_dir: Path, overrides: List[str], write: bool = True) -> Tuple[RunConfig, List[str]]:
    """The run's config with the eval.* overrides, and the eval job's --config (a copy in
    RUN_DIR/evals named by its content) when there are any."""
    from omegaconf import OmegaConf

    cfg = to_run_config(OmegaConf.merge(OmegaConf.load(str(run_dir / CONFIG)), OmegaConf.from_dotlist(overrides)))
    if not overrides or not write:
        return cfg, []
    text = to_yaml(cfg)
    path = run_dir / evals.EVALS / f"config-{hashlib.sha256(text.encode()).hexdigest()[:10]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return cfg, ["--config", str(path)]


def hf_step(hf: Path) -> int:
    """The step of a whole Hugging Face checkpoint directory (``checkpoint-N``: N), or ConfigError."""
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf {hf}: no config.json there; give a Hugging Face model directory")
    weights = list(hf.glob("*.safetensors")) + list(hf.glob("pytorch_model*.bin"))
    sharded = [p.name for p in hf.iterdir() if p.name.startswith(("pytorch_model_fsdp_", "global_step"))]
    if not [w for w in weights if not w.name.startswith("adapter_")]:
        why = f"only sharded training state ({sharded[0]})" if sharded else "no model weights"
        raise ConfigError(f"--hf {hf}: {why}; lm-eval needs the whole model: save it gathered (DeepSpeed "
                          "stage3_gather_16bit_weights_on_model_save=true, FSDP's FULL_STATE_DICT) or convert it first")
    if not (hf / "tokenizer_config.json").is_file():
        raise ConfigError(f"--hf {hf}: no tokenizer_config.json there; lm-eval needs the model's tokenizer with its "
                          "EOS token named: save the tokenizer with the model (Trainer(processing_class=...))")
    found = re.search(r"(\d+)$", hf.name)
    return int(found.group(1)) if found else 1


def again(run_dir: Path, step: int) -> bool:
    """Make room for another evaluation of ``step``: an ended one's files move aside
    (``step_N.K``; its eval.jsonl rows stay); False while one is in flight."""
    d = evals.step_dir(run_dir, step)
    if not d.exists():
        return True
    if (d / "job.json").exists() and not (d / "result.json").exists():
        return False
    k = 1
    while d.with_name(f"{d.name}.{k}").exists():
        k += 1
    d.rename(d.with_name(f"{d.name}.{k}"))
    return True


def committed(run_dir: Path) -> List[int]:
    return sorted(int(p.parent.name[len("step_"):]) for p in (run_dir / CHECKPOINTS).glob("step_*/COMMITTED"))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        run_dir, steps, hf, overrides = parse(argv)
        dry = "--dry-run" in argv
        cfg, extra = with_overrides(run_dir, overrides, write=not dry)
        evaljobs.check_tasks(cfg, "python -m launcher.eval")
        if hf is not None:
            steps, extra = [hf_step(hf)], extra + ["--hf", str(hf)]
        else:
            saved = committed(run_dir)
            if not steps:
                steps = [s for s in saved if not (evals.step_dir(run_dir, s) / "result.json").exists()]
            missing = [s for s in steps if s not in saved]
            if missing:
                raise ConfigError(f"--step {missing[0]}: {run_dir} has no committed checkpoint of that step; its "
                                  f"checkpoints: {saved or 'none'}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dry:
        if steps:
            print(evaljobs.script(cfg, run_dir, steps[0], sys.executable, None, extra), end="")
        print(f"dry run: would submit an evaluation of step(s) {steps or 'none'} of {run_dir}")
        return 0
    env = evaljobs.submit_env()
    conf = read_run_json(run_dir).get("slurm_conf")
    if conf:
        env["SLURM_CONF"] = conf
    per_step = global_batch(cfg, build_layout(cfg))[1]  # tokens an optimizer step
    for step in steps:
        if not again(run_dir, step):
            print(f"step {step}: being evaluated (evals/step_{step:08d}/job.json); wait for it", file=sys.stderr)
            continue
        job = evaljobs.submit_step(cfg, run_dir, step, step * per_step, sys.executable, env, extra)
        print(f"evaluation of step {step}: job {job}")
    if not steps:
        print(f"{run_dir}: every committed checkpoint is evaluated already (eval.jsonl); --step N evaluates one again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
