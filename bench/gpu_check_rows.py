"""The check rows of bench/gpu_check.py that are not a launch of the toolkit.

    python bench/gpu_check_rows.py ROW [ARG] [--dry]

- ``health``: this machine's nvidia-smi, as the preflight reads it (train/harness/health.py):
  every GPU's health fields parsed (a number, a flag or "not supported", never a raw
  string), no fault reported on a healthy machine. Prints what nvidia-smi printed.
- ``write_hf DIR``: a small Hugging Face Llama written by transformers (weights generated
  here, never downloaded), for the ``hf/zero3`` row (under ``--dry`` the same shapes as
  zeros through our own writer: the launcher's dry run of that row reads only its
  config.json and safetensors headers).
- ``binding_task SCRATCH`` / ``binding_node SCRATCH``: one task with LOCAL_RANK 3 of 4 on
  a node whose tasks each see one GPU (the caller sets CUDA_VISIBLE_DEVICES to one
  device). Under ``cluster.gpu_binding=task`` the harness takes cuda:0 and a ZeRO-2 step
  runs there (DeepSpeed takes LOCAL_RANK's device unless told); under ``node`` the task
  is refused at start in one line.
- ``binding_agent SCRATCH``: the node agent as srun starts it (one task a node), forking
  one rank on this GPU: its device cuda:0 and its CPUs on its GPU's NUMA node.
- ``parity SCRATCH``: every engine row's losses within 2% of engine/ddp's at every step.

``--dry`` checks what can be checked without a GPU (a node without nvidia-smi is skipped,
the binding decision, the run directories the launcher's dry run prepares).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def health(dry: bool) -> int:
    from train.harness import health as h

    if dry:  # without nvidia-smi a node is skipped, not unhealthy (the parser's own tests:
        # tests/test_health.py, on NVIDIA's documented formats)
        return 0 if "skipped" in h.gpu_health(smi="nvidia-smi-not-here") else 1
    for args in (["-L"], [f"--query-gpu={','.join(h.GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                 [f"--query-remapped-rows={','.join(h.REMAP_FIELDS)}", "--format=csv,noheader,nounits"]):
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True)
        print(f"$ nvidia-smi {' '.join(args)}  (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
    report = h.gpu_health()
    print(json.dumps(report, indent=1, default=str))
    if "skipped" in report:
        return 1
    raw = [f"GPU {g.get('index')}: {k}={v!r}" for g in report["gpus"] for k, v in g.items()
           if k.startswith(("ecc.", "retired_pages.", "remapped_rows.")) and isinstance(v, str)]
    if raw:
        print("fields left unparsed: " + "; ".join(raw))
    if report["unhealthy"]:
        print("unhealthy: " + "; ".join(report["unhealthy"]))
    return 1 if raw or report["unhealthy"] else 0


def write_hf(path: str, dry: bool = False) -> int:
    """The model written by transformers (the GPU row loads what transformers wrote); under
    ``--dry`` the same config.json and safetensors of zeros, written without torch or
    transformers (~0.1 s instead of ~9 CPU-s of imports): the launcher's dry run reads only
    the config and the tensors' headers."""
    if dry:
        return _write_hf_headers(Path(path))
    import torch  # a few MB on CPU in a second
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**HF_SHAPE, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    print(f"wrote {path}: {sorted(p.name for p in Path(path).iterdir())}")
    return 0


HF_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=256)


def _write_hf_headers(path: Path) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    from spec.config import ModelConfig
    from spec.hf import expected_shapes, hf_config

    m = ModelConfig(dim=HF_SHAPE["hidden_size"], ffn_hidden_dim=HF_SHAPE["intermediate_size"],
                    n_layers=HF_SHAPE["num_hidden_layers"], n_heads=HF_SHAPE["num_attention_heads"],
                    n_kv_heads=HF_SHAPE["num_key_value_heads"], vocab_size=HF_SHAPE["vocab_size"], max_seq_len=512)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(m), indent=1))
    save_file({name: np.zeros(shape, np.float32) for name, shape in expected_shapes(m).items()},
              str(path / "model.safetensors"))
    print(f"wrote {path} (--dry: zeros, our writer): {sorted(p.name for p in path.iterdir())}")
    return 0


PARITY_RTOL = 0.02  # bf16: 8 bits of mantissa, ~0.4% a rounding (tests/test_bf16_parity.py)


def parity(scratch: Path, dry: bool) -> int:
    """Every engine row's loss at every step within PARITY_RTOL of engine/ddp's (the same
    model, data, seed and steps): writes SCRATCH/parity.json (engine -> worst relative
    difference) and fails when one is beyond it or has other steps. Under ``--dry`` the rows
    it reads are listed."""
    from bench.gpu_check import ENGINES, _losses, engine_dir

    others = [name for name in ENGINES if name != "ddp"]
    if dry:
        print(f"compares {', '.join(others)} with ddp: {[engine_dir(scratch, n).name for n in ENGINES]}")
        return 0

    def losses(name: str) -> dict:
        return _losses(engine_dir(scratch, name))

    reference, worst, bad = losses("ddp"), {}, []
    if not reference:
        print(f"no losses in {engine_dir(scratch, 'ddp')}: engine/ddp did not run")
        return 1
    for name in others:
        got = losses(name)
        if set(got) != set(reference):
            bad.append(f"{name}: steps {sorted(got)} vs ddp's {sorted(reference)}")
            continue
        worst[name] = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
        print(f"{name}: worst {100 * worst[name]:.2f}% from ddp ({[round(got[s], 4) for s in sorted(got)]})")
        if worst[name] > PARITY_RTOL:
            bad.append(f"{name} {100 * worst[name]:.2f}% > {100 * PARITY_RTOL:.0f}%")
    print(f"ddp: {[round(reference[s], 4) for s in sorted(reference)]}")
    (scratch / "parity.json").write_text(json.dumps(worst))
    if bad:
        print("not the same maths: " + "; ".join(bad))
    return 1 if bad else 0


def main(argv: list) -> int:
    dry = "--dry" in argv
    args = [a for a in argv if a != "--dry"]
    name = args[0]
    if name == "health":
        return health(dry)
    if name == "write_hf":
        return write_hf(args[1], dry)
    if name == "parity":
        return parity(Path(args[1]), dry)
    if name in ("binding_task", "binding_node"):
        from bench.gpu_check_binding import binding_row

        return binding_row(name.split("_")[1], Path(args[1]), dry)
    if name == "binding_agent":
        from bench.gpu_check_binding import agent_row

        return agent_row(Path(args[1]), dry)
    print(f"unknown row {name!r}: health, write_hf DIR, binding_task SCRATCH, binding_node SCRATCH, binding_agent "
          "SCRATCH, parity SCRATCH")
    return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
