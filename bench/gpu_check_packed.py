"""The packing rows of bench/gpu_check.py (``data.packing=true``: flex attention on CUDA).

- ``packed_data DIR``: the repository's chat fixtures prepared into DIR (the ``train/packed``
  row trains on them; its launcher dry run reads them too, so ``--dry`` prepares them as well);
- ``packed_equal``: on the GPU, in fp32 (IEEE matmuls), a packed row of four documents
  through flex attention (compiled, the document block mask) gives each document the loss
  and gradients it has alone, unpacked through SDPA, and another document's tokens changed
  leave its logits bitwise unchanged (tests/test_packing.py checks the same on CPU, where
  the model takes SDPA with a dense mask). ``--dry``: the same on CPU (the dense path),
  so the row's own code is run in CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (100, 61, 40, 50)  # inputs of four documents in one row of 256 (the rest padding)
SEQ = 256


def packed_data(out: str) -> int:
    from train.data.prepare import main

    fix = REPO / "tests" / "fixtures" / "chat"
    return main([str(fix / "conversations.jsonl"), "--chat", "--tokenizer", str(fix / "qwen"), "--out", out,
                 "--max-length", "65", "--no-progress"]) or 0


def packed_equal(dry: bool) -> int:
    import torch

    from spec.config_model import ModelConfig
    from train.model import build_model, materialise

    device = torch.device("cpu" if dry else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=384, max_seq_len=SEQ)
    model = build_model(cfg)
    materialise([model], 0, device)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 384, (n + 1,), generator=gen) for n in LENGTHS]
    inputs = torch.zeros(1, SEQ, dtype=torch.long)
    targets = torch.full((1, SEQ), -100)
    positions = torch.zeros(1, SEQ, dtype=torch.long)
    at, spans = 0, []
    for d in docs:
        n = len(d) - 1
        inputs[0, at:at + n], targets[0, at:at + n], positions[0, at:at + n] = d[:-1], d[1:], torch.arange(n)
        spans.append((at, n))
        at += n
    positions[0, at:] = torch.arange(SEQ - at)
    inputs, targets, positions = inputs.to(device), targets.to(device), positions.to(device)

    def loss_and_grads(*args):
        model.zero_grad()
        loss = model(*args)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    worst = [0.0, 0.0]
    for (at, n), d in zip(spans, docs):
        own = torch.full_like(targets, -100)
        own[0, at:at + n] = targets[0, at:at + n]
        loss, grads = loss_and_grads(inputs, own, positions)
        alone_in = torch.zeros(1, SEQ, dtype=torch.long, device=device)
        alone_tg = torch.full((1, SEQ), -100, device=device)
        alone_in[0, :n], alone_tg[0, :n] = d[:-1].to(device), d[1:].to(device)
        ref, ref_grads = loss_and_grads(alone_in, alone_tg)
        worst[0] = max(worst[0], float((loss - ref).abs() / ref.abs()))
        worst[1] = max(worst[1], max(float((g - r).norm() / r.norm().clamp_min(1e-12)) for g, r in zip(grads, ref_grads)))
    with torch.no_grad():
        logits = model(inputs, positions=positions)
        other = inputs.clone()
        a, n = spans[0]
        other[0, a:a + n] = (other[0, a:a + n] + 1) % 384
        changed = model(other, positions=positions)
    b, m = spans[1]
    bitwise = torch.equal(changed[0, b:b + m], logits[0, b:b + m])
    print(f"{device}: per-document loss worst relative difference {worst[0]:.2e}, gradients {worst[1]:.2e}; "
          f"another document changed, logits bitwise unchanged: {bitwise}")
    return 0 if worst[0] < 1e-4 and worst[1] < 1e-3 and bitwise else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--dry"]
    sys.path.insert(0, str(REPO))
    if args[0] == "packed_data":
        sys.exit(packed_data(args[1]))
    sys.exit(packed_equal("--dry" in sys.argv))
