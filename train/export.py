"""``python -m train.export RUN_DIR OUT_DIR [--dtype D] [--max-shard-size BYTES] [--merge]``: the run's
newest committed checkpoint as a Hugging Face Llama directory (see :mod:`train.hf_io`); a
LoRA run's as a PEFT adapter directory, or with ``--merge`` merged into its base
(:mod:`train.lora_io`).
Users call it as ``python -m launcher.export``, which checks the run directory first."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from spec.config import to_run_config
from spec.data import tokenizer_of
from spec.peft import lora_enabled
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
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run (+peft=lora): the base with the adapters merged, as a full model (default: "
                        "the PEFT adapter directory, adapter_config.json + adapter_model.safetensors)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = to_run_config(args.run_dir / CONFIG)
    ckpt = find_latest(args.run_dir / CHECKPOINTS, report=lambda msg: print(msg, file=sys.stderr))
    if ckpt is None:
        print(f"error: {args.run_dir} has no committed checkpoint to export; run it (or set "
              "checkpoint.every_steps) first", file=sys.stderr)
        return 2
    if args.merge and not lora_enabled(cfg):
        print(f"error: --merge: {args.run_dir} is not a LoRA run (peft.method={cfg.peft.method}); its export is the "
              "full model already: drop --merge", file=sys.stderr)
        return 2
    if lora_enabled(cfg) and not args.merge:
        from train.lora_io import export_adapter

        export_adapter(ckpt, cfg, args.out_dir)
        print(f"exported the LoRA adapter of {ckpt.name} of {args.run_dir} to {args.out_dir} (PEFT's "
              "adapter_config.json + adapter_model.safetensors; --merge: the merged model)")
        return 0
    tokenizer, eos, bos = tokenizer_of(cfg)
    source = None
    if args.merge:
        from train.lora_io import merged_source

        source = merged_source(ckpt, cfg)
    files = export(ckpt, cfg.model, args.out_dir, DTYPES[args.dtype], args.max_shard_size, tokenizer, eos, bos,
                   source=source)
    print(f"exported {ckpt.name} of {args.run_dir} to {args.out_dir} ({len(files)} safetensors file(s), "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
