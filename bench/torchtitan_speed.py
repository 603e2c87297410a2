"""torchtitan's own trainer on a Llama 3 of given dimensions, synthetic tokens: one JSON line.

    python bench/torchtitan_speed.py [--compile] [--steps 20] [--seq-len 2048] [--batch 4] ...
    torchrun --nproc-per-node N bench/torchtitan_speed.py ... [-- --parallelism.data_parallel_shard_degree=N ...]
    python bench/torchtitan_speed.py --cpu --dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --vocab 256 \\
        --seq-len 64 --batch 2 --steps 3 --warmup 1 --precision fp32     # the CPU proof (gloo)

The other half of ``make gpu-check``'s speed rows (bench/gpu_check.py ``speed/*``): the same
model, micro-batch and sequence as the built-in trainer's row, through torchtitan's own
``torchtitan.train.main(Trainer)`` -- its model (``models.llama3``), its parallelize
function (per-block ``torch.compile``, AC, FSDP when the mesh has a data-parallel shard
axis), its optimizer, loss, metrics and training loop. What this file adds is a TrainSpec
registered under ``sto_bench`` (torchtitan's ``register_train_spec``, its documented way
for a model defined outside it), which is llama3's spec with:

- ``model_args``: one flavor ``bench``, a ``TransformerModelArgs`` of the dimensions asked
  (default Llama 3.2 1B: dim 2048, 16 layers, 32 / 8 heads, ffn 8192, vocab 128256);
- ``build_dataloader_fn``: ``ParallelAwareDataloader`` over uniform random tokens (seeded
  by the data-parallel rank): nothing is read or downloaded; no tokenizer (only flex /
  varlen attention ask for one; the bench uses sdpa), validator nor state-dict adapter;
- ``build_metrics_processor_fn``: torchtitan's, its logger also handing each step's
  metrics to this script (``metrics.log_freq=1``).

Tokens/s is torchtitan's own ``throughput(tps)`` (tokens per device over the wall time
between two logged steps), its median over the steps after ``--warmup``; peak memory its
``memory/max_active(GiB)`` / ``max_reserved(GiB)``, the max over those steps. MFU is OURS:
tokens/s per GPU x ``spec.model_size.flops_per_token`` of the same dimensions / peak (the
built-in trainer's formula, which counts the head's matmul as torchtitan does, tied or
not), so the two rows' ratio is their tokens/s'; torchtitan's own figure is beside it.

Differences that stay: torchtitan 0.2.x's Llama 3 does not tie its embeddings (the head
is its own 262M-parameter matrix at the 1B shape: same matmuls, more optimizer state);
its RoPE carries Llama 3.1's scaling. bf16 as the built-in DDP row: fp32 parameters under
``torch.autocast(bf16)`` (torchtitan's ``maybe_enable_amp`` on one GPU).

Stand-ins where a package is absent, each raising if called: ``datasets`` (imported by
torchtitan.train, never used by the synthetic loader; the JSON says ``"datasets":
"stub"``) and torchtitan's MoE kernels (the one module importing triton, absent from
torch's CPU build). ``--cpu`` (the proof without a GPU) points torchtitan's device at the
CPU (gloo; its memory figures read null there), one process or two under torchrun as DDP
(``-- --parallelism.data_parallel_replicate_degree=2 --parallelism.data_parallel_shard_degree=1``;
FSDP on gloo stops at ``ReduceOp.PREMUL_SUM``). ``--dry`` prints torchtitan's command line
and, where torchtitan is installed, checks that its ConfigManager parses it as meant.

Versions: torchtitan 0.2.2 imports and runs on torch 2.11 (the GPU machine) and 2.13 (run
here on the CPU, with and without ``--compile``); 0.3.0 needs
``torch.distributed.fsdp.DataParallelMeshDims`` (not in 2.11) and reorganised its config,
so this file drives the 0.2 API (``torchtitan.train.Trainer`` + ``JobConfig`` + TrainSpec).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import types
from pathlib import Path
from statistics import median
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from spec.config import ModelConfig  # noqa: E402  (pure, no torch)
from spec.model_size import flops_per_token  # noqa: E402

SPEC_NAME, FLAVOR = "sto_bench", "bench"
PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, as bench/gpu_check.py's SPEED_PEAK_TFLOPS
SUPPORTED = ("0.2.",)  # the torchtitan API this file drives (Trainer + JobConfig + TrainSpec)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """This script's flags; what follows ``--`` goes to torchtitan's own CLI unchanged."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--ffn-dim-multiplier", type=float, default=1.5)
    p.add_argument("--multiple-of", type=int, default=256)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--untied", action="store_true",
                   help="our ModelConfig without tied embeddings, as torchtitan's Llama 3 (default: tied, as "
                        "conf/model/llama3_1b.yaml; the FLOPs a token are the same)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per GPU (torchtitan local_batch_size)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compile, first steps)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--compile", action="store_true", help="torchtitan's compile.enable (model and loss)")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                   help="torchtitan's activation_checkpoint.mode (the built-in trainer's speed rows: none)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo): the proof without a GPU")
    p.add_argument("--out", default=None, help="torchtitan's job.dump_folder (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the result line to this file (rank 0)")
    p.add_argument("--dry", action="store_true",
                   help="no run, no torch or torchtitan import: print torchtitan's command line and our FLOPs a "
                        "token (bench/gpu_check.py --dry checks its rows this way)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        p.error("dim must divide by n_heads and n_heads by n_kv_heads")
    args.titan_extra = extra
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The project's ModelConfig of these dimensions: what OUR FLOP formula reads."""
    return ModelConfig(name="torchtitan_bench", dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                       n_kv_heads=args.n_kv_heads, vocab_size=args.vocab, ffn_dim_multiplier=args.ffn_dim_multiplier,
                       multiple_of=args.multiple_of, rope_theta=args.rope_theta, max_seq_len=args.seq_len,
                       tie_embeddings=not args.untied)


def titan_model_kwargs(args: argparse.Namespace) -> Dict[str, object]:
    """torchtitan's ``TransformerModelArgs`` fields (models/llama3/model/args.py) of the same model."""
    return dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                vocab_size=args.vocab, ffn_dim_multiplier=args.ffn_dim_multiplier, multiple_of=args.multiple_of,
                rope_theta=args.rope_theta, max_seq_len=args.seq_len)


def titan_argv(args: argparse.Namespace, dump_folder: str) -> List[str]:
    """torchtitan's command line (its tyro ``JobConfig``), then what followed ``--``."""
    out = [f"--job.dump_folder={dump_folder}", "--job.description=sto torchtitan speed bench",
           f"--model.name={SPEC_NAME}", f"--model.flavor={FLAVOR}",
           f"--training.seq_len={args.seq_len}", f"--training.local_batch_size={args.batch}",
           f"--training.steps={args.steps}", "--training.dtype=float32",
           f"--training.mixed_precision_param={'bfloat16' if args.precision == 'bf16' else 'float32'}",
           f"--optimizer.lr={args.lr}", f"--lr_scheduler.warmup_steps={min(2, args.steps)}",
           f"--activation_checkpoint.mode={args.ac}", "--metrics.log_freq=1",
           "--metrics.disable_color_printing", "--checkpoint.no-enable", "--validation.no-enable"]
    if args.compile:
        out += ["--compile.enable", "--compile.components=model,loss"]
    if args.cpu:
        out += ["--comm.trace_buf_size=0", "--optimizer.implementation=foreach"]
    return out + list(args.titan_extra)


def summarize(steps: List[Dict[str, float]], warmup: int, fpt: float, peak_tflops: float) -> Dict[str, object]:
    """Medians over torchtitan's logged steps after ``warmup``; MFU by our ``fpt``."""
    steady = [m for m in steps if m["step"] > warmup]
    if not steady:
        raise ValueError(f"no logged step after step {warmup} (logged: {[m['step'] for m in steps]})")
    tps = median(m["throughput(tps)"] for m in steady)
    return {"tokens_per_s": round(tps, 1), "mfu": round(tps * fpt / (peak_tflops * 1e12), 4),
            "step_s": round(median(m["time_metrics/end_to_end(s)"] for m in steady), 4),
            "peak_active_gib": _gib(max(m["memory/max_active(GiB)"] for m in steady)),
            "peak_reserved_gib": _gib(max(m["memory/max_reserved(GiB)"] for m in steady)),
            "titan_mfu": round(median(m["mfu(%)"] for m in steady) / 100, 4),
            "loss_first": round(steps[0]["loss_metrics/global_avg_loss"], 4),
            "loss_last": round(steps[-1]["loss_metrics/global_avg_loss"], 4),
            "steps_measured": len(steady)}


def _gib(value: float) -> Optional[float]:
    """torchtitan's figure in GiB; None where the device keeps no allocator statistics
    (its monitor reads -1 bytes: the CPU)."""
    return round(value, 2) if value >= 0 else None


# ---------------------------------------------------------------- the run (needs torch + torchtitan)

def single_process_env() -> None:
    """Run as rank 0 of 1 when no launcher (torchrun) set the rendezvous variables."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def stub_datasets() -> bool:
    """A ``datasets`` stand-in when the package is absent: torchtitan imports it at module
    level (hf_datasets/text_datasets.py) but the synthetic loader never calls it."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return False

    def unavailable(*_a, **_k):
        raise RuntimeError("datasets is not installed: bench/torchtitan_speed.py feeds synthetic tokens only")

    top, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    top.load_dataset, top.Dataset, top.__path__ = unavailable, type("Dataset", (), {}), []
    dist.split_dataset_by_node = unavailable
    top.distributed = dist
    sys.modules.update({"datasets": top, "datasets.distributed": dist})
    return True


def stub_moe_kernels() -> bool:
    """A stand-in for torchtitan's MoE kernels (models/moe/kernels.py, loaded by ``import
    torchtitan``, the one module importing triton) where triton is absent: torch's CPU build."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return False

    def unavailable(*_a, **_k):
        raise RuntimeError("triton is not installed: torchtitan's MoE kernels are not available")

    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = kernels.fill_indices_wrapper = unavailable
    sys.modules["torchtitan.models.moe.kernels"] = kernels
    return True


class _CpuDevice:
    """torchtitan's calls on ``torch.cuda`` (device, memory stats, name) answered for the CPU."""

    def __init__(self) -> None:
        import torch

        self._cpu = torch.cpu

    def __getattr__(self, name):
        return getattr(self._cpu, name)

    def _nothing(self, *_a, **_k) -> None:
        return None

    set_device = reset_peak_memory_stats = empty_cache = synchronize = _nothing

    def current_device(self) -> int:
        return 0

    def get_device_name(self, _device=None) -> str:
        return "cpu"

    def get_device_properties(self, _device=None):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, _device=None) -> Dict[str, int]:
        return {}


def use_cpu() -> None:
    """Point torchtitan at the CPU: ``torchtitan.tools.utils.device_type`` / ``device_module``
    and the copies the modules imported so far took of them (``import torchtitan`` loads
    distributed/parallel_dims.py, which builds the device mesh of ``device_type``); the
    modules imported later (the trainer, metrics, distributed/utils.py) copy the new ones."""
    import torchtitan.tools.utils as tt_utils

    old = {"device_type": tt_utils.device_type, "device_module": tt_utils.device_module}
    new = {"device_type": "cpu", "device_module": _CpuDevice()}
    for name, module in list(sys.modules.items()):
        if name == "torchtitan" or name.startswith("torchtitan."):
            for attr, value in old.items():
                if getattr(module, attr, None) is value:
                    setattr(module, attr, new[attr])


def register_spec(args: argparse.Namespace, seen: List[Dict[str, float]]):
    """llama3's TrainSpec with the bench's model, synthetic loader and metrics tap."""
    import dataclasses

    import torch
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.metrics import BaseLogger, build_metrics_processor
    from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec

    class SyntheticTokens(IterableDataset):
        """Uniform random tokens, ``seq_len + 1`` a sample as torchtitan's text dataset yields them."""

        def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
            self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

        def __iter__(self):
            gen = torch.Generator().manual_seed(self.seed)
            while True:
                x = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
                yield {"input": x[:-1]}, x[1:]

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        del tokenizer
        return ParallelAwareDataloader(SyntheticTokens(args.vocab, job_config.training.seq_len, 1234 + dp_rank),
                                       dp_rank=dp_rank, dp_world_size=dp_world_size,
                                       batch_size=job_config.training.local_batch_size)

    class Tap(BaseLogger):
        def __init__(self, inner: BaseLogger) -> None:
            self.inner = inner

        def log(self, metrics, step: int) -> None:
            seen.append({"step": step, **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}})
            self.inner.log(metrics, step)

        def close(self) -> None:
            self.inner.close()

    def build_metrics(job_config, parallel_dims, model_args=None, tag=None):
        processor = build_metrics_processor(job_config, parallel_dims, model_args, tag)
        processor.logger = Tap(processor.logger)
        seen_flops.append(processor)
        return processor

    seen_flops: List[object] = []
    spec = dataclasses.replace(get_train_spec(), model_args={FLAVOR: TransformerModelArgs(**titan_model_kwargs(args))},
                               build_dataloader_fn=build_dataloader, build_tokenizer_fn=None, build_validator_fn=None,
                               build_metrics_processor_fn=build_metrics, state_dict_adapter=None)
    register_train_spec(SPEC_NAME, spec)
    return seen_flops


def run(args: argparse.Namespace) -> Optional[Dict[str, object]]:
    import tempfile

    single_process_env()
    dump = args.out or tempfile.mkdtemp(prefix="torchtitan_speed_")
    # torchtitan's ConfigManager.parse_args reads sys.argv[1:], a default bound when
    # torchtitan.config.manager is imported (by ``import torchtitan``): set it first
    sys.argv = [sys.argv[0], *titan_argv(args, dump)]
    stubbed = stub_datasets()
    stub_moe_kernels()
    if args.cpu:
        use_cpu()
    import torch
    import torchtitan

    version = getattr(torchtitan, "__version__", "?")
    if not version.startswith(SUPPORTED):
        raise SystemExit(f"torchtitan {version}: this bench drives the {SUPPORTED[0]}x API "
                         "(torchtitan.train.Trainer, JobConfig, TrainSpec); install torchtitan 0.2.2")
    seen: List[Dict[str, float]] = []
    processors = register_spec(args, seen)
    import torchtitan.train as titan_train

    titan_train.main(titan_train.Trainer)  # torchtitan's own entry: config, Trainer(config).train(), close
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    cfg = model_config(args)
    fpt = flops_per_token(cfg, args.seq_len)
    out = {"bench": "torchtitan", "torchtitan": version, "torch": torch.__version__,
           "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
           "world": int(os.environ.get("WORLD_SIZE", "1")), "seq_len": args.seq_len, "batch": args.batch,
           "steps": args.steps, "warmup": args.warmup, "precision": args.precision, "compile": args.compile,
           "ac": args.ac, "flops_per_token": fpt, "peak_tflops": args.peak_tflops,
           "titan_flops_per_token": getattr(processors[0], "num_flops_per_token", None) if processors else None,
           "tps_source": "torchtitan MetricsProcessor throughput(tps), log_freq 1",
           "datasets": "stub" if stubbed else "installed", "flops_tied_embeddings": cfg.tie_embeddings,
           "titan_tied_embeddings": False,
           **summarize(seen, args.warmup, fpt, args.peak_tflops)}
    print(json.dumps(out), flush=True)
    if args.json:  # its folder may not exist: torchtitan writes nothing to its dump folder without checkpoints
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out) + "\n")
    return out


def parsed_by_torchtitan(args: argparse.Namespace, argv: List[str]) -> str:
    """``argv`` through torchtitan's ConfigManager where torchtitan is installed, the fields
    the row depends on read back (exit naming those parsed otherwise)."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return "not parsed: torchtitan is not installed here"
    stub_datasets()
    stub_moe_kernels()
    import torchtitan
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(argv)
    want = {("model", "name"): SPEC_NAME, ("model", "flavor"): FLAVOR, ("training", "seq_len"): args.seq_len,
            ("training", "local_batch_size"): args.batch, ("training", "steps"): args.steps,
            ("compile", "enable"): args.compile, ("activation_checkpoint", "mode"): args.ac,
            ("metrics", "log_freq"): 1, ("compile", "components"): ["model", "loss"]}
    got = {k: getattr(getattr(cfg, k[0]), k[1]) for k in want}
    wrong = {".".join(k): (got[k], v) for k, v in want.items() if got[k] != v}
    if wrong:
        raise SystemExit(f"torchtitan {torchtitan.__version__} parsed the command line otherwise (got, wanted): {wrong}")
    return f"parsed by torchtitan {torchtitan.__version__}"


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.dry:
        titan = titan_argv(args, args.out or "DUMP_FOLDER")
        print(json.dumps({"dry": True, "torchtitan_argv": titan, "parsed": parsed_by_torchtitan(args, titan),
                          "flops_per_token": flops_per_token(model_config(args), args.seq_len)}))
        return
    run(args)


if __name__ == "__main__":
    main()
