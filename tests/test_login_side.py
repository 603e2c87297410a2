"""The login side never needs torch: every module of launcher/, spec/, slurm/ and our Hydra
plugin imports, and a dry run, a dry-run sweep and a plan run, with ``torch`` and
``deepspeed`` blocked in ``sys.modules`` (an import of either raises ImportError)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

# A finder that refuses torch and deepspeed and reports every attempt at exit, so an
# import that the code catches (try/except ImportError) still fails the test.
BLOCK = """
import atexit, sys
class _Refuse:
    tried = []
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "deepspeed"):
            self.tried.append(name)
            raise ImportError(f"import of {name} halted: the login side must not import it")
        return None
sys.meta_path.insert(0, _Refuse())
atexit.register(lambda: _Refuse.tried and print("TRIED:", sorted(set(_Refuse.tried)), file=sys.stderr))
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})


def test_the_block_bites(tmp_path):
    """The prelude really blocks torch (else the tests below would prove nothing)."""
    proc = _run("import torch", tmp_path)
    assert proc.returncode != 0 and "import of torch halted" in proc.stderr
    caught = _run("try:\n    import deepspeed\nexcept ImportError:\n    pass", tmp_path)
    assert caught.returncode == 0 and "TRIED: ['deepspeed']" in caught.stderr


def test_every_login_side_module_imports_without_torch(tmp_path):
    code = """
import importlib, pkgutil
names = []
for root in ("spec", "slurm", "launcher", "hydra_plugins.sto_sweep"):
    pkg = importlib.import_module(root)
    names.append(root)
    for info in pkgutil.walk_packages(pkg.__path__, root + "."):
        importlib.import_module(info.name)
        names.append(info.name)
print(len(names), "modules")
assert "launcher.plan.cli" in names and "launcher.track.report" in names and "spec.support" in names
"""
    proc = _run(code, tmp_path)
    assert proc.returncode == 0 and "TRIED:" not in proc.stderr, proc.stderr
    assert int(proc.stdout.split()[0]) > 30


@pytest.mark.parametrize("argv", [
    ["launcher", "+cluster=h100x8", "cluster.nodes=2", "+strategy=fsdp_tp", "launcher.dry_run=true"],
    ["launcher", "+cluster=a100x8", "cluster.nodes=1,2", "+strategy=zero3,fsdp", "launcher.dry_run=true", "-m"],
    ["launcher.plan", "+cluster=h100x8", "+model=llama3_70b", "cluster.nodes=4"],
])
def test_dry_runs_and_plans_run_without_torch(tmp_path, argv):
    module, args = argv[0], argv[1:]
    code = f"import runpy; sys.argv = {[module, *args]!r}; runpy.run_module({module!r}, run_name='__main__')"
    proc = _run(code, tmp_path)
    assert proc.returncode == 0 and "TRIED:" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    if module == "launcher":
        assert proc.stdout.count("dry run: nothing submitted") == (4 if "-m" in args else 1), proc.stdout[-2000:]
    else:
        assert "fsdp" in proc.stdout and "zero3" in proc.stdout
