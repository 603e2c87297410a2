"""``python -m train.export RUN_DIR OUT_DIR [--dtype D] [--max-shard-size BYTES]``: the run's
newest committed checkpoint as a Hugging Face Llama directory (see :mod:`train.hf_io`).
Users call it as ``python -m launcher.export``, which checks the run directory first."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spec.config import to_run_config
from spec.rundir import CHECKPOINTS, CONFIG
from train.checkpoint.manifest import find_latest
from train.hf_io import export

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the exported weights (default: float32, the trainer's master weights)")
    p.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes per safetensors shard (5 GB)")
    return p.parse_args(argv)


def tokenizer_of(cfg) -> tuple:
    """(tokenizer path, eos id, bos id) of the run's prepared data (its manifest), else Nones."""
    manifest = Path(cfg.data.path or "", "manifest.json") if cfg.data.source in ("tokens", "chat") else None
    if manifest is None or not manifest.is_file():
        return None, None, None
    info = json.loads(manifest.read_text())
    tok = info.get("tokenizer_copy")
    return (Path(manifest.parent, tok) if tok else None), info.get("eos_id"), info.get("bos_id")


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = to_run_config(args.run_dir / CONFIG)
    ckpt = find_latest(args.run_dir / CHECKPOINTS, report=lambda msg: print(msg, file=sys.stderr))
    if ckpt is None:
        print(f"error: {args.run_dir} has no committed checkpoint to export; run it (or set "
              "checkpoint.every_steps) first", file=sys.stderr)
        return 2
    tokenizer, eos, bos = tokenizer_of(cfg)
    files = export(ckpt, cfg.model, args.out_dir, DTYPES[args.dtype], args.max_shard_size, tokenizer, eos, bos)
    print(f"exported {ckpt.name} of {args.run_dir} to {args.out_dir} ({len(files)} safetensors file(s), "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
