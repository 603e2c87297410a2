"""Every command the README and the docs pages show runs (tests/docpages.py says how:
local ones for real, on the tiny model for 2 steps in a temporary directory; Slurm and GPU
ones as dry runs; make targets that run the suite or need a cluster or a GPU checked to
exist). docs/gpu.md has its own file, tests/test_docs_gpu.py.

One test per page runs its commands in the page's order, as a reader would, so a run
directory one command makes is the RUN_DIR of the next. A finished local sweep of two
points, made once, stands for SWEEP_DIR (and for RUN_DIR where the page made no run)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import warm
from conftest import REPO, run_dir_of
from docpages import PageRun, commands, makefile_targets

PAGES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
                               if p.name != "gpu.md")  # gpu.md: tests/test_docs_gpu.py
CORPUS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + i)) for i in range(600)]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A finished local sweep of two points (one rank each, tiny model, 2 steps each)."""
    root = tmp_path_factory.mktemp("sweep")
    proc = warm.launcher(["train.steps=2", "cluster.gpus_per_node=1", "train.seed=1,2", "-m",
                          f"launcher.root={root / 'runs'}"], cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir_of(proc.stdout).parent


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    """The reader's files: a corpus (corpus/*.jsonl, books/), a team config directory."""
    root = tmp_path_factory.mktemp("work")
    (root / "corpus").mkdir()
    (root / "books").mkdir()
    with open(root / "corpus" / "a.jsonl", "w") as f:
        for doc in CORPUS[:500]:
            f.write(json.dumps({"text": doc}) + "\n")
    for i, doc in enumerate(CORPUS[500:]):
        (root / "books" / f"{i}.txt").write_text(doc)
    conf = root / "myteam" / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "cluster" / "ourcluster.yaml").write_text(
        (REPO / "conf/cluster/a100x8.yaml").read_text().replace("name: a100x8", "name: ourcluster")
        .replace("partition: gpu", "partition: big"))
    (conf / "experiment" / "bigrun.yaml").write_text(
        "# @package _global_\ncluster:\n  nodes: 4\nstrategy:\n  activation_checkpointing: full\n"
        "train:\n  steps: 1000\n")
    return {"root": root, "confdir": conf, "data": root / "data" / "mytext", "export": root / "export",
            "chat": root / "data" / "mychat", "fixtures": REPO / "tests" / "fixtures",
            "experiments": REPO / "conf" / "experiment"}


@pytest.fixture(scope="module")
def hf_dir(work) -> Path:
    """A tiny Hugging Face Llama saved by transformers, with a tokenizer.json trained on the
    corpus (what /models/Llama-3.2-1B stands for)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = work["root"] / "models" / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = work["root"] / "tok"
    proc = warm.run_module("train.data.prepare", [str(work["root"] / "corpus"), "--train-tokenizer", "300",
                                                  "--out", str(tok), "--no-progress"], cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    shutil.copy(tok / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs(page, sweep, work, request):
    text = (REPO / page).read_text()
    paths = dict(work)
    if "/models/Llama-3.2-1B" in text:
        paths["hf"] = request.getfixturevalue("hf_dir")
    lines = commands(REPO / page)
    assert lines, f"{page} shows no ```bash command"
    run = PageRun(work=work["root"], paths=paths, sweep=sweep)
    for line in lines:
        run.run(line)
    run.finish()


def test_readme_leads():
    """The README's first lines are the two commands of a fresh machine, CI runs the
    second, the README stays a few screens, and it links every docs page."""
    text = (REPO / "README.md").read_text()
    assert text.startswith("```bash\nmake demo ") and text.split("\n")[2].startswith("make test ")
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, flags=re.M), ".ci/run must call the README's test command"
    assert len(text.splitlines()) <= 160
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", text))
    assert linked == {p.name for p in (REPO / "docs").glob("*.md")}, linked


def test_docs_links_resolve():
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_make_targets_the_pages_name_exist():
    named = set()
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        named |= set(re.findall(r"`make (?:-s )?([a-z][\w-]*)", page.read_text()))
    assert named and named <= makefile_targets(), named - makefile_targets()
