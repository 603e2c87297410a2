"""Every command docs/gpu.md shows is run here: launcher lines as dry runs (they name GPU
clusters), `pip install` as pip's own dry run of the project, `make gpu-wheels` for real
into a temporary folder, `make gpu-check`'s script in its dry mode (no GPU here)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import docpages
from conftest import REPO, launcher

DOC = REPO / "docs" / "gpu.md"


def commands() -> list:
    """The command lines of the page's ```bash blocks, comments dropped (tests/docpages.py)."""
    return docpages.commands(DOC)


def test_the_page_shows_the_commands_this_file_runs():
    kinds = {" ".join(c.split()[:3 if c.startswith("python") else 2]) for c in commands()}
    assert kinds == {"pip install", "python -m launcher", "python -m launcher.doctor", "make gpu-wheels",
                     "make gpu-check"}, kinds


@pytest.mark.parametrize("line", [c for c in commands() if c.startswith("python -m launcher")])
def test_launcher_lines_pass_their_dry_run(tmp_path, line):
    args = shlex.split(line)[3:]
    proc = launcher([*args, *([] if "launcher.dry_run=true" in args else ["launcher.dry_run=true"])], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    if "gpu_binding=task" in line:
        assert "--gpus-per-task=1" in out and "--gpu-bind=per_task:1" in out
    if "+cluster=a100x8" in line and "doctor" not in line:
        assert "asked per node" in out and "--mem=0" in out and "--wckey" not in out


def test_pip_install_line_builds_the_project(tmp_path):
    line = next(c for c in commands() if c.startswith("pip install"))
    args = shlex.split(line)[2:]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                           "--no-build-isolation", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "slurm-torch-orchestrator" in proc.stdout


def test_make_gpu_wheels_builds_what_a_gpu_image_lacks(tmp_path):
    env = {**os.environ, "GPU_WHEELS": str(tmp_path / "whl"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench/gpu_wheels.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {p.name.split("-")[0].lower() for p in (tmp_path / "whl").glob("*.whl")}
    assert {"hydra_core", "omegaconf", "antlr4_python3_runtime", "submitit", "deepspeed", "pydantic",
            "pydantic_core", "isal", "hjson",  # and speed/torchtitan's (bench/torchtitan_wheels.sh)
            "torchtitan", "torchdata", "tyro", "docstring_parser", "typeguard", "tensorboard", "protobuf",
            "absl_py", "torchao"} <= names, names  # torchao: strategy.float8's, a cp310-abi3 wheel (3.12 takes it)
    assert all("cp312" in p.name or "py3-none-any" in p.name or "abi3" in p.name for p in (tmp_path / "whl").glob("*.whl"))
    assert sum(p.stat().st_size for p in (tmp_path / "whl").glob("*.whl")) < 16 << 20  # tree + wheels < 64 MiB


def test_make_gpu_check_script_runs_in_dry_mode(tmp_path):
    env = {**os.environ, "GPU_PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench/gpu_check.sh"), "--dry", "--only", "health", "engine/ddp",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu-check: 2 passed, 0 failed" in proc.stdout and (tmp_path / "gpu_check.md").exists()


def test_make_targets_named_by_the_page_exist():
    targets = docpages.makefile_targets()
    assert {"gpu-check", "gpu-wheels", "test-gpu", "test-torch-floor"} <= targets
    assert Path(REPO / "bench/gpu_check.sh").exists()


def test_every_test_make_test_torch_floor_names_is_collected(request):
    """The floor run names test ids one by one; a renamed case must fail here, in make test, not only in
    CI's floor run afterwards (which once stopped at 'not found: ...[hsdp-2x2]'). In the suite the
    session has collected every test (before its shard was picked): no second collection."""
    show = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "show-floor-tests: ; @echo $(FLOOR_TESTS)",
                           "show-floor-tests"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stderr
    ids = shlex.split(show.stdout)
    assert len(ids) > 20, ids
    collected = getattr(request.config, "sto_collected", set())
    if {i.split("::")[0] for i in ids} <= {c.split("::")[0] for c in collected}:
        missing = [i for i in ids if i not in collected and not any(c.startswith((i + "::", i + "[")) for c in collected)]
        assert missing == [], missing
        return
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "tests collected" in proc.stdout, proc.stdout[-2000:]
