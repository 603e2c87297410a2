"""Frozen code per run (launcher/snapshot.py, launcher/codetree.py): what is copied, that
the copy is content-addressed and shared by a sweep's points, that the tasks' Python
imports it before the checkout, the size refusal, ``launcher.snapshot=false``, and what
``launcher.resume`` keeps or refreshes. No Slurm: tests/test_frozen_code_slurm.py runs a job."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import warm
from conftest import REPO
from warm import pythonpath
from helpers import compose_run
from launcher import codetree, entrypoint, launch, relaunch, snapshot
from spec.config import ConfigError, to_yaml
from spec.layout import build_layout
from spec.rundir import CONFIG, ENTRYPOINT, read_run_json, update_run_json

SLURM = ["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1"]


def git_repo(root: Path, files: dict) -> Path:
    """A git repository at ``root`` whose one commit holds ``files`` (path -> text)."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    return root


def sparse(path: Path, size: int) -> None:
    """A file of ``size`` bytes that takes no disk (its size is what the limit counts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def point(cfg, run_dir: Path, entry=None, trees=None) -> launch.Point:
    return launch.Point(cfg, build_layout(cfg), run_dir, None, run_dir.name, [], False, entry,
                        snapshot.plan(cfg, run_dir, entry, {} if trees is None else trees))


def test_a_git_tree_is_copied_as_the_working_tree_holds_it(tmp_path):
    repo = git_repo(tmp_path / "repo", {"pkg/a.py": "A = 1\n", "pkg/gone.py": "", "run.sh": "#!/bin/sh\n",
                                        ".gitignore": "data/\n*.log\n"})
    (repo / "run.sh").chmod(0o755)
    (repo / "pkg/a.py").write_text("A = 2\n")  # modified, not committed: what the user sees runs
    (repo / "pkg/gone.py").unlink()  # deleted, not committed
    (repo / "pkg/new.py").write_text("NEW = 1\n")  # untracked, not ignored
    (repo / "data").mkdir()
    (repo / "data/x.bin").write_bytes(b"x")  # ignored
    (repo / "y.log").write_text("log")  # ignored
    (repo / "link").symlink_to("pkg/a.py")
    sparse(repo / "runs/r/checkpoint.bin", 10)  # the run root inside the tree: left out
    tree = codetree.list_tree(repo.resolve(), "git", excluded=[repo.resolve() / "runs"])
    assert {rel for rel, _ in tree.files} == {".gitignore", "pkg/a.py", "pkg/new.py", "run.sh", "link"}
    copy, key = codetree.copy_tree(tree, tmp_path / "cache")
    assert copy == tmp_path / "cache" / key[:codetree.KEY_CHARS] and key == codetree.digest(tree)
    assert (copy / "pkg/a.py").read_text() == "A = 2\n" and (copy / "pkg/new.py").is_file()
    assert not (copy / "pkg/gone.py").exists() and not (copy / "data").exists() and not (copy / "runs").exists()
    assert (copy / "link").is_symlink() and os.readlink(copy / "link") == "pkg/a.py"
    assert (copy / "run.sh").stat().st_mode & 0o777 == 0o555
    assert (copy / "pkg/a.py").stat().st_mode & 0o777 == 0o444  # read-only: edits belong in the source


def test_copies_are_content_addressed(tmp_path):
    repo = git_repo(tmp_path / "repo", {"m.py": "X = 1\n", "n.py": "Y = 1\n"})
    cache = tmp_path / "cache"
    first, key = codetree.copy_tree(codetree.list_tree(repo, "git"), cache)
    inode = (first / "m.py").stat().st_ino
    again, key_again = codetree.copy_tree(codetree.list_tree(repo, "git"), cache)
    assert (again, key_again) == (first, key) and (again / "m.py").stat().st_ino == inode  # not copied again
    (repo / "m.py").write_text("X = 2\n")
    edited, key_edited = codetree.copy_tree(codetree.list_tree(repo, "git"), cache)
    assert key_edited != key and edited != first and (edited / "m.py").read_text() == "X = 2\n"
    assert (first / "m.py").read_text() == "X = 1\n"  # the first copy is untouched
    (repo / "m.py").write_text("X = 1\n")
    assert codetree.copy_tree(codetree.list_tree(repo, "git"), cache)[0] == first
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, edited.name])  # no partial copy left



def test_copies_no_run_names_go_once_stale_and_reuse_keeps_one(tmp_path):
    """A launch prunes its cache: a copy that no run directory beside it names in run.json
    (its run deleted, or resumed with fresh code) and that nobody made or reused for an
    hour is removed; named, recent and reused copies stay."""
    import time

    repo = git_repo(tmp_path / "repo", {"m.py": "X = 1\n"})
    cache = tmp_path / "runs" / ".code"

    def copy(text: str) -> Path:
        (repo / "m.py").write_text(text)
        return codetree.copy_tree(codetree.list_tree(repo, "git"), cache)[0]

    orphan, named, reused, fresh = copy("X = 1\n"), copy("X = 2\n"), copy("X = 3\n"), copy("X = 4\n")
    (tmp_path / "runs" / "r1").mkdir()
    update_run_json(tmp_path / "runs" / "r1", code_snapshot={"frozen": True, "trees": [{"copy": str(named)}]})
    past = time.time() - 2 * codetree.STALE_S
    for c in (orphan, named, reused):
        os.utime(c, (past, past))
    assert copy("X = 3\n") == reused  # made again by a launch: its age starts over
    assert snapshot.referenced_copies(cache) == [named]
    asked = []
    assert codetree.prune_copies(cache, [fresh], lambda: asked.append(1) or snapshot.referenced_copies(cache)) == [orphan]
    assert asked == [1]  # run.json files read once, as a stale copy was there
    # the only stale copy left is this launch's own: no run.json is read
    assert codetree.prune_copies(cache, [named], lambda: asked.append(2) or []) == [] and asked == [1]
    assert sorted(p.name for p in cache.iterdir()) == sorted(c.name for c in (named, reused, fresh))

def test_a_sweeps_points_share_one_copy_of_the_project(tmp_path):
    cfg = compose_run(SLURM)
    sweep = tmp_path / "multirun" / "s"
    trees, memo = {}, {}
    points = [point(cfg, sweep / str(n), trees=trees) for n in range(2)]
    for p in points:
        launch.freeze_code(p, memo)
    assert len(trees) == 1  # the checkout listed once for the sweep
    copy = points[0].frozen.python_path
    assert points[1].frozen.python_path == copy and [p.name for p in (sweep / ".code").iterdir()] == [copy.name]
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in ("launcher/snapshot.py", "train/job.py", "slurm/task_wrapper.sh", "conf/config.yaml"):
        assert rel in listed and (copy / rel).read_bytes() == (REPO / rel).read_bytes()
    record = snapshot.record(points[0].frozen, cfg)
    assert record["frozen"] and record["python_path"] == str(copy)
    assert record["trees"][0]["source"] == str(REPO) and record["trees"][0]["sha256"].startswith(copy.name)


def test_the_tasks_import_the_copy_before_the_checkout(tmp_path):
    """The batch script's lines, run from the checkout with the checkout on PYTHONPATH (and
    the editable install's path entry): the copy's modules are imported. Without ``-P``
    the working directory (the checkout) would come first: the control."""
    cfg = compose_run(SLURM)
    p = point(cfg, tmp_path / "runs" / "r")
    launch.freeze_code(p)
    copy = p.frozen.python_path
    python, wrapper = p.frozen.task_python()
    assert wrapper == str(copy / "slurm" / "task_wrapper.sh") and python.endswith(" -P")
    script = launch.submit.render_script(cfg, p.layout, p.run_dir, code=p.frozen)
    assert p.frozen.setup_lines()[0] in script and f"/bin/bash {wrapper} {python} -u -m submitit.core._submit" in script
    probe = "import train.job, slurm.submitit_adapter as s; print(train.job.__file__); print(s.__file__)"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    for command, where in ((python, copy), (shlex.quote(sys.executable), REPO)):
        line = f"{p.frozen.setup_lines()[0]}; exec /bin/bash {wrapper} {command} -c '{probe}'"
        out = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, check=True)
        assert [Path(f).parent.parent for f in out.stdout.splitlines()] == [where, where], (command, out.stdout)


def test_a_tree_too_large_is_refused_with_the_fix(tmp_path):
    repo = git_repo(tmp_path / "repo", {"m.py": "X = 1\n"})
    sparse(repo / "weights.bin", 250 * 10 ** 6)  # untracked, not ignored: it would be copied
    with pytest.raises(ConfigError) as exc:
        codetree.list_tree(repo, "git")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("launcher.snapshot=true: ")
    assert "weights.bin, 250.0 MB" in message and "launcher.snapshot=false" in message and "git-ignore" in message
    (repo / ".gitignore").write_text("*.bin\n")
    assert [rel for rel, _ in codetree.list_tree(repo, "git").files] == [".gitignore", "m.py"]


def test_the_dry_run_refuses_a_tree_too_large_and_leaves_nothing(tmp_path):
    work = tmp_path / "work"
    (work / "train.py").parent.mkdir()
    (work / "train.py").write_text("print('hi')\n")
    sparse(work / "big.bin", 250 * 10 ** 6)
    proc = warm.launcher([*SLURM, f"entrypoint={work / 'train.py'}", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: launcher.snapshot=true: the code to freeze, "), lines
    assert f"{work} (directory)" in lines[0] and "big.bin, 250.0 MB" in lines[0]
    assert "submitted" not in proc.stdout and not (tmp_path / "runs").exists()


def test_the_dry_run_says_what_would_be_frozen(tmp_path):
    proc = warm.launcher([*SLURM, "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = re.search(r"^code: would freeze (.+?) \(git: (\d+) files, ([\d.]+) MB\) -> (\S+); ", proc.stdout, re.M)
    assert said, proc.stdout
    source, files, mb, copy = said.groups()
    assert source == str(REPO) and int(files) > 200 and 0.5 < float(mb) < 200
    assert Path(copy).parent == tmp_path / "runs" / ".code" and not Path(copy).parent.exists()  # nothing copied
    assert f"export PYTHONPATH={copy}${{PYTHONPATH:+:$PYTHONPATH}}" in proc.stdout
    assert f"{copy}/slurm/task_wrapper.sh {shlex.quote(sys.executable)} -P -u -m submitit.core._submit" in proc.stdout

    off = warm.launcher([*SLURM, "launcher.dry_run=true", "launcher.snapshot=false"], cwd=tmp_path)
    assert off.returncode == 0, off.stdout + off.stderr
    assert f"code: the tasks import {REPO} as it is when they start (launcher.snapshot=false)" in off.stdout
    assert "export PYTHONPATH" not in off.stdout and f"{shlex.quote(sys.executable)} -P " not in off.stdout
    assert ".code" not in off.stdout


def test_a_bad_value_is_refused_in_one_line(tmp_path):
    proc = warm.launcher(["launcher.snapshot=maybe", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: launcher.snapshot=maybe: give true (freeze the code at submission), false (run the checkout as it "
        "is) or refresh (launcher.resume: freeze the code anew)"), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_nothing_is_frozen_for_false_local_runs_or_installed_code():
    assert snapshot.plan(compose_run([*SLURM, "launcher.snapshot=false"]), Path("/x/r"), None, {}) is None
    local = compose_run([])
    assert snapshot.plan(local, Path("/x/r"), None, {}) is None
    assert snapshot.record(None, local) == {"frozen": False, "source": str(REPO),
                                            "why": "a local run: it runs while the command waits"}
    cfg = compose_run([*SLURM, "entrypoint=json:dumps"])  # the standard library's: part of the environment
    plan = snapshot.plan(cfg, Path("/x/r"), entrypoint.resolve(cfg), {})
    assert [t.root for t in plan.trees] == [REPO]


def _submitted(tmp_path: Path, monkeypatch):
    """A user's script in its own git repository, submitted as far as Slurm (frozen, its
    run.json written as at submission), then ended: what ``launcher.resume`` finds."""
    repo = git_repo(tmp_path / "user", {"scripts/train.py": "print('v1')\n", "lib.py": ""})
    cfg = compose_run([*SLURM, f"entrypoint={repo / 'scripts/train.py'}"])
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    p = point(cfg, run_dir, entrypoint.resolve(cfg))
    (run_dir / CONFIG).write_text(to_yaml(cfg))
    launch.freeze_code(p)
    update_run_json(run_dir, status="failed", job_id="1", code_snapshot=snapshot.record(p.frozen, cfg))
    started = []
    monkeypatch.setattr(relaunch, "check", lambda cfg: (build_layout(cfg), None, None))  # no Slurm asked
    monkeypatch.setattr(relaunch, "start", lambda session, point, **kw: started.append(point) or 0)
    return repo, run_dir, p.frozen, started


def test_resume_keeps_the_frozen_code_unless_told_to_refresh(tmp_path, monkeypatch):
    repo, run_dir, frozen, started = _submitted(tmp_path, monkeypatch)
    task_entry = json.loads((run_dir / ENTRYPOINT).read_text())
    first = Path(task_entry["path"])
    script = repo / "scripts/train.py"
    assert task_entry["source_path"] == str(script) and first == frozen.inside(script)
    assert first.read_text() == "print('v1')\n" and Path(task_entry["sys_path"]) == first.parent
    (repo / "scripts/train.py").write_text("print('v2')\n")  # edited after submission

    assert relaunch.main([str(run_dir)]) == 0
    assert started[-1].frozen.copies == frozen.copies
    assert json.loads((run_dir / ENTRYPOINT).read_text()) == task_entry

    assert relaunch.main([str(run_dir), "launcher.snapshot=refresh"]) == 0
    refreshed = started[-1].frozen
    entry = json.loads((run_dir / ENTRYPOINT).read_text())
    assert refreshed.python_path == frozen.python_path  # the project did not change: the same copy
    assert Path(entry["path"]) != first and Path(entry["path"]).read_text() == "print('v2')\n"
    assert entry["sha256"] == hashlib.sha256(b"print('v2')\n").hexdigest()

    assert relaunch.main([str(run_dir), "launcher.snapshot=false"]) == 0
    assert started[-1].frozen is None
    assert json.loads((run_dir / ENTRYPOINT).read_text())["path"] == str(repo / "scripts/train.py")


def test_resume_refuses_when_the_kept_copy_is_gone(tmp_path, monkeypatch, capsys):
    _, run_dir, frozen, started = _submitted(tmp_path, monkeypatch)
    shutil.rmtree(frozen.copies[-1][1])
    assert relaunch.main([str(run_dir)]) == 2 and not started
    assert capsys.readouterr().err.strip() == (
        f"error: launcher.snapshot=true: the run's frozen code {frozen.copies[-1][1]} is gone; set "
        "launcher.snapshot=refresh to freeze the code as it is now, or launcher.snapshot=false to run the checkout")
    assert read_run_json(run_dir)["code_snapshot"] == frozen.record
