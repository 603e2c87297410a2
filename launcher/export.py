"""``python -m launcher.export RUN_DIR OUT_DIR [--dtype bfloat16] [--max-shard-size BYTES] [--merge]``

Writes the run's newest committed checkpoint (any strategy, any sharding, DeepSpeed's
included) as a Hugging Face Llama directory that ``transformers`` loads; a LoRA run's
(``+peft=lora``) as a PEFT adapter directory (``PeftModel.from_pretrained`` loads it onto
the base), or with ``--merge`` as the base with the adapters merged. The run
directory is checked here (no torch on the login side); the conversion runs in
:mod:`train.export`, on the CPU, one shard of tensors in memory at a time.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spec.rundir import CHECKPOINTS, CONFIG


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    positional = [a for a in argv if not a.startswith("-")]
    if "-h" not in argv and "--help" not in argv:
        if len(positional) < 2:
            print("error: usage: python -m launcher.export RUN_DIR OUT_DIR [--dtype bfloat16] [--merge]", file=sys.stderr)
            return 2
        run_dir = Path(positional[0])
        if not (run_dir / CONFIG).is_file():
            print(f"error: RUN_DIR={run_dir} is not a run directory (no {CONFIG}); give the run_dir "
                  "the launcher printed", file=sys.stderr)
            return 2
        if not any((run_dir / CHECKPOINTS).glob("step_*/COMMITTED")):
            print(f"error: RUN_DIR={run_dir} has no committed checkpoint; run it with "
                  "checkpoint.save_final=true (or checkpoint.every_steps=N)", file=sys.stderr)
            return 2
    return subprocess.run([sys.executable, "-m", "train.export", *argv]).returncode


if __name__ == "__main__":
    sys.exit(main())
