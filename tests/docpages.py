"""The commands a documentation page shows, and how the docs tests run each of them.

A page's commands are the lines of its fenced ```bash blocks (a trailing ``\\`` joins the
next line; ``#`` comments after two spaces, and whole comment lines, are dropped; ``; ``
separates commands). :class:`PageRun` runs them in the page's order, as a reader would:

- ``python -m launcher ...`` naming a Slurm or GPU cluster (any ``+cluster=`` but
  ``local``) runs as a dry run (``launcher.dry_run=true``); a local one runs for real,
  with ``train.steps=2`` unless the line sets the steps; both with
  ``launcher.root=<tmp>/runs``, from the checkout (so ``examples/...`` resolve);
- a local run with ``fault.raise_at_step`` must fail (the page shows a run to resume);
- ``launcher.resume`` of a Slurm run directory is a dry run, of a local one real;
- ``launcher.status|logs|report|cancel|export|plan``, ``train.data.prepare`` and
  ``python -m train`` run for real (``python -m train RUN_DIR``: the last launch's);
- ``launcher.eval`` (it submits Slurm jobs) runs as its dry run (``--dry-run``), of the
  page's last real run;
- ``launcher.list`` runs for real from the page's work directory: its default ROOT,
  ``runs``, is the runs root of the page's launches;
- ``bench/*.py`` scripts run with ``--help`` (all of a page's in one interpreter, by
  :meth:`PageRun.finish`): every option the line shows must exist;
- ``pip install`` runs as pip's own dry run of the project;
- ``make`` targets that would run the suite, start a cluster or need a GPU are checked to
  exist (``make demo`` runs what its recipe runs: ``python -m launcher``);
- ``torchrun`` lines are run by tests/test_torchrun.py; ``tensorboard`` and ``wandb`` are
  not ours.

Placeholders stand for what a reader has: ``RUN_DIR`` (and ``runs/<run>``) is the
directory of the page's last run (resume: its last launch, dry ones included; status,
logs, cancel, export: its last real run), else a point of a finished local sweep;
``SWEEP_DIR`` (and ``runs/multirun/<sweep>``) is that sweep; the others are in
:data:`PLACEHOLDERS` and are made by the test.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import warm

REPO = Path(__file__).resolve().parent.parent
SHELL_SYNTAX = set("|&;<>()$`*?~\\")  # a line with any of these runs in bash
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
SMALL = ["train.steps=2"]  # added to a real local run that does not set its steps
NOT_OURS = ("tensorboard ", "wandb ")
COVERED_ELSEWHERE = {"torchrun ": "tests/test_torchrun.py",
                     "python -m launcher.stacks ": "tests/test_stacks.py"}  # needs a running run
# make targets the docs tests cannot run (the suite itself, a cluster, a GPU, a benchmark)
MAKE_CHECKED_ONLY = {"test", "test-fast", "test-gpu", "test-torch-floor", "cluster-up", "cluster-down",
                     "cluster-status", "cluster-env", "gpu-check", "gpu-wheels", "bench"}
# placeholder -> key in PageRun.paths (made by the test before the page runs)
PLACEHOLDERS = {"/models/Llama-3.2-1B": "hf", "/models/my-finetune": "export", "OUT_DIR": "export",
                "/data/mytext": "data", "~/myteam/conf": "confdir", "/data/mychat": "chat",
                "tests/fixtures": "fixtures", "conf/experiment": "experiments"}


# Runs each ``[script, args...]`` of argv[1] (JSON) with --help as ``python script`` would
# (runpy, the script's folder first on sys.path), and prints the list of their help texts.
HELP_ALL = """
import contextlib, io, json, runpy, sys
out = []
for args in json.loads(sys.argv[1]):
    sub = [args[1]] if len(args) > 1 and not args[1].startswith("-") else []
    sys.argv, buf = [args[0], *sub, "--help"], io.StringIO()
    sys.path.insert(0, args[0].rsplit("/", 1)[0])
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(args[0], run_name="__main__")
        except SystemExit:
            pass
    sys.path.pop(0)
    out.append(buf.getvalue())
print(json.dumps(out))
"""


def commands(page: Path) -> List[str]:
    """The command lines of ``page``'s ```bash blocks, in order, comments dropped."""
    out = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = "" if line.lstrip().startswith("#") else line.split("  #", 1)[0]
            out.extend(part.strip() for part in line.split("; ") if part.strip())
    return [" ".join(c.split()) if "'" not in c and '"' not in c else c for c in out]


def makefile_targets() -> set:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))


def _module(words: List[str]) -> Optional[str]:
    return words[2] if len(words) > 2 and words[0] == "python" and words[1] == "-m" else None


@dataclass
class PageRun:
    """Runs one page's commands in order; ``paths`` holds the placeholders' stand-ins."""

    work: Path
    paths: Dict[str, Path]
    sweep: Path  # a finished local sweep (SWEEP_DIR)
    last_launch: Optional[Path] = None
    last_real: Optional[Path] = None
    log: List[str] = field(default_factory=list)
    bench: List[List[str]] = field(default_factory=list)

    # ---- placeholders -------------------------------------------------------------
    def substitute(self, line: str, real_run: bool) -> str:
        """``line`` with its placeholders replaced, in one pass (longest first), by their
        stand-ins' paths shell-quoted: the line runs in bash or is split by shlex, and a
        checkout's path may hold a space (tests/fixtures, conf/experiment)."""
        run = (self.last_real if real_run else self.last_launch or self.last_real) or self.sweep / "0"
        values = {text: self.paths[key] for text, key in PLACEHOLDERS.items() if text in line}
        values.update({"runs/multirun/<sweep>": self.sweep, "SWEEP_DIR": self.sweep, "runs/<run>": run, "RUN_DIR": run})
        pattern = "|".join(re.escape(text) for text in sorted(values, key=len, reverse=True))
        return re.sub(pattern, lambda m: shlex.quote(str(values[m.group(0)])), line)

    # ---- one command --------------------------------------------------------------
    def run(self, doc_line: str) -> Optional[subprocess.CompletedProcess]:
        """Run (or check) one documented command; fails the test when it fails. Returns
        the process, or None for a command that is only checked."""
        words = doc_line.split()
        if doc_line.startswith(NOT_OURS):
            return None
        for prefix, test in COVERED_ELSEWHERE.items():
            if doc_line.startswith(prefix):
                assert (REPO / test).exists() and prefix.strip() in (REPO / test).read_text(), (doc_line, test)
                return None
        if doc_line.startswith("eval ") or words[0] == "make":
            return self._make(doc_line)
        if "pip" in words[0] and words[1:2] == ["install"]:
            return self._pip(words[2:])
        if re.match(r"(\.venv/bin/)?python bench/", doc_line):
            self.bench.append(words[1:])  # checked together by finish(): one interpreter
            return None
        module = _module(words)
        assert module, f"no test runs this documented command: {doc_line}"
        if module == "launcher.resume":
            line = self.substitute(doc_line, real_run=False)
            run_dir = Path(shlex.split(line)[3])
            if "backend: slurm" in (run_dir / "config.yaml").read_text() and "launcher.dry_run=" not in line:
                line += " launcher.dry_run=true"
            return self._shell(line, cwd=REPO)
        if module in ("launcher", "launcher.doctor"):
            return self._launch(doc_line)
        if module == "train":  # the run directory the page's last launch wrote (a dry run's too)
            return self._shell(self.substitute(doc_line, real_run=False), cwd=REPO)
        if module in ("launcher.status", "launcher.logs", "launcher.report", "launcher.cancel", "launcher.export",
                      "launcher.plan"):
            return self._shell(self.substitute(doc_line, real_run=True), cwd=REPO)
        if module == "launcher.list":  # ROOT runs (the default): where the page's launches went
            return self._shell(self.substitute(doc_line, real_run=True), cwd=self.work)
        if module == "launcher.eval":  # submits Slurm jobs: its dry run, of the page's last real run
            return self._shell(self.substitute(doc_line, real_run=True) + " --dry-run", cwd=self.work)
        if module == "train.data.prepare":
            return self._shell(self.substitute(doc_line, real_run=True) + " --no-progress", cwd=self.work)
        raise AssertionError(f"no test runs this documented command: {doc_line}")

    def _launch(self, doc_line: str) -> subprocess.CompletedProcess:
        line = self.substitute(doc_line, real_run=False)
        clusters = re.findall(r"\+cluster=(\S+)", line)
        dry = "launcher.dry_run=true" in line or any(c != "local" for c in clusters)
        extra = [shlex.quote(f"launcher.root={self.work / 'runs'}")]
        if dry and "launcher.dry_run=true" not in line:
            extra.append("launcher.dry_run=true")
        if not dry:
            extra += [o for o in SMALL if o.split("=")[0] + "=" not in line]
        injected = "fault.raise_at_step=" in line  # a run the page fails on purpose, to resume it
        proc = self._shell(line + " " + " ".join(extra), cwd=REPO, fails=injected)
        if injected:
            assert "status: failed" in proc.stdout and "injected failure" in proc.stdout + proc.stderr, proc.stdout
        dirs = [Path(x.split(": ", 1)[1]) for x in proc.stdout.splitlines() if x.startswith("run_dir: ")]
        if dirs:
            self.last_launch = dirs[-1]
            if not dry:
                self.last_real = dirs[-1]
        return proc

    def _make(self, doc_line: str) -> Optional[subprocess.CompletedProcess]:
        target = re.search(r"make (?:-s )?([\w-]+)", doc_line).group(1)
        assert target in makefile_targets(), f"{doc_line}: the Makefile has no target {target}"
        if target == "demo":  # what its recipe runs, on the tiny model for a few steps
            recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
            assert "python -m launcher $(ARGS)" in recipe, recipe
            return self._launch("python -m launcher")
        assert target in MAKE_CHECKED_ONLY, f"{doc_line}: say how the docs tests cover make {target}"
        return None

    def _pip(self, args: List[str]) -> subprocess.CompletedProcess:
        args = [a.strip("'") for a in args]
        return self._run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                          "--no-build-isolation", *args], cwd=REPO, expect="slurm-torch-orchestrator")

    def finish(self) -> None:
        """The bench lines' ``--help``, all in one interpreter (each imports torch): every
        option a line shows must be in its script's help."""
        if not self.bench:
            return
        proc = self._run([sys.executable, "-c", HELP_ALL, json.dumps(self.bench)], cwd=REPO)
        helps = json.loads(proc.stdout.splitlines()[-1])
        for args, text in zip(self.bench, helps):
            missing = [o for o in args[1:] if o.startswith("--") and o.split("=")[0] not in text]
            assert "usage:" in text and not missing, f"{' '.join(args)}: --help does not list {missing}:\n{text}"

    # ---- subprocesses -------------------------------------------------------------
    def _shell(self, line: str, cwd: Path, fails: bool = False) -> subprocess.CompletedProcess:
        """``line`` as bash runs it; a plain ``python -m MODULE ARGS`` (nothing for the
        shell to expand, redirect or chain) forked from the warm server instead
        (tests/warm.py: the same module run as ``-m`` runs it, without an interpreter's
        start and torch's imports for the launcher and each local rank)."""
        words = shlex.split(line)
        if words[:2] == ["python", "-m"] and not any(c in line for c in SHELL_SYNTAX):
            proc = warm.run_module(words[2], words[3:], cwd=cwd, env=self._env(), timeout=600)
            return self._check(proc, fails=fails)
        return self._run(["bash", "-c", line], cwd=cwd, fails=fails)

    def _env(self) -> dict:
        return {**os.environ, "PYTHONPATH": warm.pythonpath(),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def _run(self, argv: List[str], cwd: Path, expect: Optional[str] = None,
             fails: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, cwd=cwd, env=self._env(), capture_output=True, text=True, timeout=600)
        return self._check(proc, expect=expect, fails=fails)

    def _check(self, proc: subprocess.CompletedProcess, expect: Optional[str] = None,
               fails: bool = False) -> subprocess.CompletedProcess:
        argv = [str(a) for a in proc.args]
        self.log.append(" ".join(argv))
        assert (proc.returncode != 0) == fails, f"{' '.join(argv)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if expect:
            assert expect in proc.stdout, proc.stdout
        return proc
