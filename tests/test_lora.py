"""LoRA in the built-in trainer (``+peft=lora``), checked against PEFT itself.

- the checks of ``peft.*``: one line naming the field, the value and the fix;
- in one process: the base tensors bitwise unchanged by training, only the adapters in
  the optimizer;
- a 2-rank FSDP run (local backend) against PEFT's LoRA on the transformers Llama built
  from the same base, over the same batches (fp32): the losses within 1e-5 at every step;
  its checkpoint holds the adapters and their optimizer state only (its size); the
  exported adapter directory loads with ``PeftModel.from_pretrained`` and gives our
  logits; the ``--merge`` export gives the logits of the adapter applied.
(2 nodes on the local Slurm cluster, FSDP and ZeRO-3, preempted and resumed:
tests/test_lora_slurm.py, with the same reference.)
"""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import warm
from conftest import REPO
from helpers import compose_run
from spec.config import ConfigError, RunConfig, to_run_config
from spec.hf import our_shapes
from spec.peft import check_peft, check_same_base, base_identity, target_names
from spec.rundir import read_metrics, read_run_json
from warm import launcher

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = ["+peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=0.02", "train.seq_len=32", "data.num_tokens=50000",
        "checkpoint.save_final=true"]


# ---- the reference: PEFT on transformers' Llama, built from the run's base ----

def base_hf_dir(cfg: RunConfig, out: Path) -> Path:
    """The run's frozen base as a Hugging Face directory (model.hf_path's, or its initial weights)."""
    from train.hf_io import export
    from train.lora_io import base_source

    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    export(Path("unused"), cfg.model, out, source=base_source(cfg))
    return out


def peft_model(cfg: RunConfig, base: Path):
    """PEFT's LoRA of the run's config on the base, A as our trainer starts it, B zeros."""
    from train.initial import initial_tensor

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    lora = peft.LoraConfig(r=cfg.peft.rank, lora_alpha=cfg.peft.alpha, lora_dropout=cfg.peft.dropout,
                           target_modules=target_names(cfg), task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    ours = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
            "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                layer, module = name.split(".layers.")[1].split(".")[0], name.split(".lora_A.")[0].rsplit(".", 1)[1]
                p.copy_(initial_tensor(cfg.model, f"layers.{layer}.{ours[module]}.lora_A", tuple(p.shape),
                                       cfg.train.seed))
    return model


def peft_losses(run_dir: Path, scratch: Path, steps: int) -> list:
    """The losses of PEFT's LoRA trained as the run was (its learning rate at each step, its
    AdamW, clipping and global batches: each step's samples of every rank in one batch)."""
    from train.data.chat_loader import build_loader

    cfg = to_run_config(run_dir / "config.yaml")
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    model = peft_model(cfg, base_hf_dir(cfg, scratch / "base"))
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    whole = copy.deepcopy(cfg)
    whole.train.micro_batch_size *= rows[1]["global_batch_size"] // (cfg.train.micro_batch_size * cfg.train.grad_accum)
    loader = build_loader(whole, 0, 1)
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = (torch.cat(t) for t in zip(*loader.next_step()))
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = rows[step]["lr"]
        opt.step()
        losses.append(loss.item())
    return losses


def assert_losses_as_peft(run_dir: Path, scratch: Path, steps: int) -> None:
    got = {r["step"]: r["loss"] for r in read_metrics(run_dir)}  # a resumed run: the latest segment's
    want = peft_losses(run_dir, scratch, steps)
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    diffs = [abs(got[s + 1] - w) for s, w in enumerate(want)]
    assert max(diffs) < 1e-5, list(zip([got[s] for s in sorted(got)], want))
    assert abs(want[-1] - want[0]) > 1e-3  # the adapters trained: the comparison means something


def ours_from_checkpoint(run_dir: Path):
    """Our model with the run's base and the adapters of its newest checkpoint."""
    from train.checkpoint.manifest import find_latest
    from train.lora import prepare_peft
    from train.lora_io import checkpoint_source
    from train.model import build_model, materialise

    cfg = to_run_config(run_dir / "config.yaml")
    model = build_model(cfg.model)
    prepare_peft(model, cfg)
    materialise([model], cfg.train.seed, torch.device("cpu"), cfg.model.hf_path)
    shapes, read = checkpoint_source(find_latest(run_dir / "checkpoints", print))
    missing, unexpected = model.load_state_dict(read(list(shapes)), strict=False)
    assert not unexpected and all(not k.endswith(("lora_A", "lora_B")) for k in missing)
    return model.eval()


def export(run_dir: Path, out: Path, *extra: str) -> None:
    proc = warm.run_module("launcher.export", [str(run_dir), str(out), *extra], cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def assert_exports_load_in_peft(run_dir: Path, scratch: Path) -> None:
    """The adapter directory loads in PEFT with our logits; the merged model gives the same."""
    cfg = to_run_config(run_dir / "config.yaml")
    export(run_dir, scratch / "adapter")
    export(run_dir, scratch / "merged", "--merge")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_hf_dir(cfg, scratch / "base0"))
    theirs = peft.PeftModel.from_pretrained(base, scratch / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(scratch / "merged").eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got, whole = theirs(input_ids=tokens).logits, ours_from_checkpoint(run_dir)(tokens), merged(tokens).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(whole, want, rtol=0, atol=1e-5), (whole - want).abs().max()
    with torch.no_grad(), theirs.disable_adapter():
        bare = theirs(input_ids=tokens).logits
    assert not torch.allclose(bare, want, atol=1e-4)  # the adapter moved the logits


# ---- the tests ----

def _refused(overrides: list, *expected: str) -> None:
    from spec.layout import build_layout
    from spec.support import check_supported

    cfg = compose_run(overrides)
    with pytest.raises(ConfigError) as err:
        check_peft(cfg)
        check_supported(cfg, build_layout(cfg))  # the layouts LoRA does not run on
    msg = str(err.value)
    assert "\n" not in msg and all(e in msg for e in expected), msg


def test_peft_settings_are_checked_in_one_line():
    _refused(["peft.method=qlora"], "peft.method='qlora'", "+peft=lora")
    _refused(["+peft=lora", "peft.rank=0"], "peft.rank=0", "at least 1")
    _refused(["+peft=lora", "peft.target_modules=[q_proj,lm_head]"], "'lm_head'", "q_proj, k_proj")
    _refused(["+peft=lora", "+strategy=pp"], "strategy.pipeline_parallel=2", "strategy.pipeline_parallel=1")
    _refused(["+peft=lora", "+strategy=tp"], "strategy.tensor_parallel=", "strategy.tensor_parallel=1")
    cfg = compose_run(["+experiment=r1_distill_sft", "+peft=lora"])
    check_peft(cfg)  # the recipe with LoRA composes and passes
    assert (cfg.peft.method, cfg.peft.rank, cfg.strategy.zero_stage) == ("lora", 16, 3)
    assert target_names(cfg) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_a_checkpoint_of_another_base_is_refused(tmp_path):
    cfg = compose_run(["+peft=lora"])
    own = base_identity(cfg)
    check_same_base(own, own, "ckpt")
    cfg.train.seed += 1
    with pytest.raises(ConfigError, match=r"^checkpoint ckpt holds a LoRA adapter of base initial weights of seed 0"):
        check_same_base(own, base_identity(cfg), "ckpt")
    with pytest.raises(ConfigError, match="this run's base is no LoRA"):
        check_same_base(own, {}, "ckpt")
    check_same_base({}, {}, "ckpt")  # neither is LoRA


def test_the_bases_fingerprint_is_read_once_a_process_before_the_ranks_are_forked(tmp_path, monkeypatch):
    """A node's agent (or a local rank 0) reads the base's files for its fingerprint in its
    warm imports; the ranks it forks inherit it and read nothing (one read a node, not a
    rank: a 70B base's 30 shards at 4,096 ranks would be ~123k opens at once)."""
    import builtins

    import train.main
    from spec.config import to_yaml
    from spec.peft import _fingerprint
    from test_hf import _save_hf

    hf = _save_hf(tmp_path / "hf", seed=5, num_key_value_heads=2)
    cfg = compose_run(["+peft=lora", f"model.hf_path={hf}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))
    _fingerprint.cache_clear()
    opened, real = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real(f, *a, **k))[1])
    monkeypatch.setattr(train.main, "freeze_imports", lambda: None)  # gc.freeze: not in the test's process
    train.main.warm_imports(str(tmp_path / "run"))
    read = [f for f in opened if f.startswith(str(hf))]
    assert read and all(f.endswith(".safetensors") for f in read), opened
    first = base_identity(cfg)  # what a forked rank computes: inherited, no file read
    assert len([f for f in opened if f.startswith(str(hf))]) == len(read)
    _fingerprint.cache_clear()
    assert base_identity(cfg) == first  # the same digest read again


def test_base_stays_bitwise_and_only_adapters_train():
    from train.lora import prepare_peft
    from train.model import build_model, materialise
    from train.strategies.base import TorchEngine, build_adamw

    cfg = compose_run(["+peft=lora", "peft.rank=4", "peft.dropout=0.1"])
    model = build_model(cfg.model)
    prepare_peft(model, cfg)
    materialise([model], 0, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TorchEngine(model, build_adamw(model, cfg.optim, torch.device("cpu")), cfg, torch.device("cpu"))
    adapters = {n for n in before if n.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 7 * cfg.model.n_layers
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in adapters}
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=gen)
        engine.train_step([(tokens[:, :-1], tokens[:, 1:])], lr=1e-2)
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    assert torch.equal(engine.eval_loss(batch), engine.eval_loss(batch))  # evaluation: no dropout
    assert model.layers["0"].attention.wq.lora_dropout.training  # ... and training's back on
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]) and p.grad is None, name


def test_the_base_check_finds_a_changed_tensor(tmp_path):
    """peft.verify_base's comparison (train.lora.changed_base), in one process: a model loaded
    from a Hugging Face base compares equal, tensor by tensor; one element changed is named."""
    from train.hf_io import export
    from train.lora import changed_base, prepare_peft
    from train.lora_io import base_source
    from train.model import build_model, materialise

    cfg = compose_run(["+peft=lora", "peft.rank=4"])
    export(Path("unused"), cfg.model, tmp_path / "base", source=base_source(cfg))
    model = build_model(cfg.model)
    prepare_peft(model, cfg)
    materialise([model], 0, torch.device("cpu"), hf_path=str(tmp_path / "base"))
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    read = base_source(compose_run(["+peft=lora", f"model.hf_path={tmp_path / 'base'}"]))[1]
    assert changed_base(model, read, cfg.model.tie_embeddings, main=True) == (frozen, [])
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[3, 5] += 1e-6
    assert changed_base(model, read, cfg.model.tie_embeddings, main=True) == (
        frozen, ["layers.1.feed_forward.w2.weight"])


@pytest.mark.slow
def test_fsdp_lora_trains_as_peft_and_exports_for_it(tmp_path):
    """From a Hugging Face base (transformers' Llama with grouped-query attention): fails at
    step 9 (its checkpoint of step 8), is checked, then resumed on 1 rank."""
    from test_hf import _save_hf

    hf = _save_hf(tmp_path / "hf", seed=5, num_key_value_heads=2)
    run = tmp_path / "run"
    proc = launcher(["+strategy=fsdp", *LORA, f"model.hf_path={hf}", "train.steps=10", "checkpoint.every_steps=4",
                     "fault.raise_at_step=9", f"launcher.run_dir={run}"], cwd=tmp_path)
    assert proc.returncode != 0 and read_run_json(run)["status"] == "failed", proc.stdout + proc.stderr
    assert_losses_as_peft(run, tmp_path, 8)
    assert_exports_load_in_peft(run, tmp_path)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert ckpt.name == "step_00000008"
    cfg = to_run_config(run / "config.yaml")
    shapes = our_shapes(cfg.model)
    targets = [n for n in shapes if n.startswith("layers.") and n.endswith(("wq.weight", "wk.weight", "wv.weight",
                                                                            "wo.weight", "w1.weight", "w2.weight",
                                                                            "w3.weight"))]
    adapter = sum(cfg.peft.rank * (shapes[n][0] + shapes[n][1]) for n in targets)  # A: r x in, B: out x r
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata()
    tensors = {k: math.prod(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    names = [f"{n[:-len('.weight')]}.{m}" for n in targets for m in ("lora_A", "lora_B")]
    assert set(tensors) == {f"app.model.{n}" for n in names} | {
        f"app.optim.state.{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq", "step")}
    assert sum(tensors.values()) == 3 * adapter + len(names)  # A, B and Adam's two moments (+ its step counts)
    # On disk: those fp32 values and DCP's own bytes per stored item (a few hundred items
    # here: the hyperparameters of each adapter, pickled), never the base (fp32: base * 4).
    saved = sum(f.stat().st_size for f in (ckpt / "dcp").glob("*.distcp"))
    assert 12 * adapter < saved < 12 * adapter + 2048 * len(md.storage_data), (saved, adapter, len(md.storage_data))
    keys = json.loads((ckpt / "COMMITTED").read_text())["shape"]["adapter_base"]
    assert keys["hf_path"] == str(hf) and len(keys["fingerprint"]) == 16
    # Its base replaced by other weights of the same shapes: the resume is refused in one line.
    shutil.copytree(hf, tmp_path / "kept")
    _save_hf(hf, seed=6, num_key_value_heads=2)
    proc = warm.run_module("launcher.resume", [str(run), "fault.raise_at_step=0"], cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    log = (run / "logs" / "rank0.log").read_text()
    assert f"holds a LoRA adapter of base hf_path={hf} (fingerprint {keys['fingerprint']}) but this run's base is " \
           f"hf_path={hf} (fingerprint {base_identity(cfg)['adapter_base']['fingerprint']})" in log, log[-2000:]
    shutil.rmtree(hf)
    shutil.copytree(tmp_path / "kept", hf)
    # Resumed on 1 rank (the same global batch of 16): DCP reshards the adapters and their
    # Adam moments, and two more steps go on as PEFT's do.
    proc = warm.run_module("launcher.resume", [str(run), "cluster.gpus_per_node=1",
                                               "train.micro_batch_size=16", "fault.raise_at_step=0"],
                           cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert {r["world_size"] for r in read_metrics(run) if r["step"] > 8} == {1}
    assert_losses_as_peft(run, tmp_path / "resumed", 10)


def test_planner_counts_the_frozen_base_and_the_adapters():
    """The recipe (ZeRO-3, bf16, 8 GPUs) with LoRA: the base's bf16 partition and no state of
    its own, the adapters' partition, gradients (bf16 + the fp32 copy at the step), fp32
    master and Adam; under FSDP the base stays fp32 (the trainer's master weights)."""
    from launcher.plan.memory import estimate
    from spec.layout import build_layout
    from spec.model_size import count_params
    from spec.peft import adapter_params

    for strategy, base_bytes, grad_bytes, optim_bytes in (("zero3", 2, 2 + 4, 12), ("fsdp", 4, 4, 8)):
        cfg = compose_run(["+cluster=h100x8", "+experiment=r1_distill_sft", f"strategy={strategy}", "+peft=lora"])
        full = compose_run(["+cluster=h100x8", "+experiment=r1_distill_sft", f"strategy={strategy}"])
        layout = build_layout(cfg)
        mem, whole = estimate(cfg, layout), estimate(full, layout)
        psi, a, n = count_params(cfg.model), adapter_params(cfg), layout.dp
        assert a == 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # Qwen2.5-7B, r=16
        assert mem.param_bytes == pytest.approx((base_bytes * psi + base_bytes * a) / n)
        assert mem.grad_bytes == pytest.approx(grad_bytes * a / n)
        assert mem.optimizer_bytes == pytest.approx(optim_bytes * a / n)
        assert mem.activation_bytes == whole.activation_bytes and mem.param_bytes < whole.param_bytes + 1e9
        assert whole.grad_bytes + whole.optimizer_bytes > 100 * (mem.grad_bytes + mem.optimizer_bytes)
        if strategy == "zero3":  # the recipe's own figures, as docs/finetune.md gives them
            page = (REPO / "docs" / "finetune.md").read_text()
            assert f"about {mem.total_bytes / 1e9:.1f} of 80 GB a GPU, where the full fine-tune needs " \
                   f"{whole.total_bytes / 1e9:.1f}" in page


def test_planner_row_against_the_lora_papers_figure():
    """Hu et al. 2021, Sec. 4.2: GPT-3 175B with r=4 on q and v trains in 350 GB (the frozen
    weights in 2 bytes); the planner's model states summed over 64 GPUs (bench/planner_refs.py,
    whose row docs/planner.md holds)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("planner_refs", REPO / "bench" / "planner_refs.py")
    refs = sys.modules.get("planner_refs") or importlib.util.module_from_spec(spec)
    if "planner_refs" not in sys.modules:
        sys.modules["planner_refs"] = refs
        spec.loader.exec_module(refs)
    (row,) = refs.lora_rows()
    assert abs(row.ratio - 1) <= 0.01, row
    assert "174.6e9 frozen + 18.9e6 trained" in row.note
    assert refs.render([row]).splitlines()[-3] in (REPO / "docs" / "planner.md").read_text()


def test_chunked_head_loss_trains_the_adapters_as_whole_logits_do():
    """The head + loss in chunks (model.loss_chunk_tokens) through the frozen head: the same
    loss and adapter gradients as the whole logits, and no gradient for the head."""
    from train.lora import prepare_peft
    from train.model import build_model, materialise

    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    got = []
    for chunk in (0, 8):
        cfg = compose_run(["+peft=lora", "peft.rank=4", f"model.loss_chunk_tokens={chunk}"])
        model = build_model(cfg.model)
        prepare_peft(model, cfg)
        materialise([model], 0, torch.device("cpu"))
        with torch.no_grad():  # B away from zero, so that A's gradient is not zero too
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert model.output.weight.grad is None
        got.append((loss.detach(), [p.grad for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))]))
    assert torch.allclose(got[0][0], got[1][0], rtol=1e-6)
    for whole, chunked in zip(got[0][1], got[1][1]):
        assert torch.allclose(whole, chunked, rtol=1e-5, atol=1e-7) and whole.abs().sum() > 0
