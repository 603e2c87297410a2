"""What the documentation pages cite in backticks exists, so a page cannot drift from the code.

A page is README.md or docs/*.md; a citation is an inline code span (fenced blocks are
commands, run by tests/test_docs.py) or a word of one:

- a repository path (``train/loop.py``, ``conf/cluster/``, ``launcher/{status,cancel}.py``):
  the file or directory exists (a trailing ``/``: a directory); ``path:N`` or ``path:N-M``:
  the file has that many lines; ``path:name`` (``spec/cluster.py: ClusterConfig``): the
  module defines ``name``;
- a dotted name of the project's packages (``launcher.plan.gate.check_fits``,
  ``train.strategies.pp``, ``python -m launcher.resume``) or ``module:function``
  (``train.doctor:check``): each part a package, a module or a name the module defines at
  its top level (def, class, assignment, import), then a class's own members; with
  ``(args)`` the function takes that many arguments;
- a config key (``cluster.nodes``, ``checkpoint.every_steps=100``): a field of the schema
  (spec/config.py's dataclasses). ``train`` and ``launcher`` are both a package and a
  config section: ``train.X`` is the package's when ``train/X.py`` or ``train/X/`` exists
  or ``train/__init__.py`` defines X, else a key of the ``train`` section; in an override
  (``launcher.snapshot=false``) always the key.

Sources are read with ``ast``: nothing of the project is imported but spec.config (the
schema; the login side's, no torch). File names (``train.bin``, ``slurm.conf``) and paths
of a run directory are not citations of the repository.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

from spec.config import RunConfig

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGES = ("train", "launcher", "spec", "slurm", "bench", "tests", "hydra_plugins")
ROOTS = PACKAGES + ("conf", "docs", "examples", ".ci")  # a path starting ROOT/ is the repository's
SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}
FREE_FORM = {"user"}  # the user's own settings, passed on as given
# The last part of a file's name, not a module's or a key's: ``train.bin``, ``slurm.conf``.
FILE_SUFFIXES = {"bin", "pt", "json", "jsonl", "yaml", "yml", "md", "txt", "py", "sh", "conf", "err", "out",
                 "log", "safetensors", "distcp", "toml", "csv", "npy", "jinja", "gz", "html", "whl", "so"}
# Words that read like the repository's paths and are not: what each is.
NOT_REPO_PATHS = {"slurm/JOB_0_log.err": "a log in a run directory's slurm/",
                  "train/packed": "a row of make gpu-check (bench/gpu_check.py)"}

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+?)`(?!`)")
PATH = re.compile(r"^(?P<path>(?:%s)/[\w./{},@+-]*)(?::\s*(?P<ref>[\w.-]+))?$" % "|".join(map(re.escape, ROOTS)))
DOTTED = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.\w+)+)(?::(?P<attr>[A-Za-z_][\w.]*))?(?:\((?P<args>[^()]*)\))?$")
PATH_REF = re.compile(r"\b((?:%s)/[\w./-]+\.py):\s+(?=[A-Za-z_])" % "|".join(map(re.escape, ROOTS)))
MODULE_FN = re.compile(r"^[A-Za-z_]\w*(?:\.\w+)*:[A-Za-z_]\w*$")


def spans(text: str) -> Iterator[Tuple[int, str]]:
    """(line, code) of each inline code span of a page, fenced blocks left out."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in SPAN.finditer(text):
        if "\n\n" not in m.group(1):
            yield text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())


def expand(path: str) -> List[str]:
    """Brace expansion, as the shell does it: ``a/{b,c}.py`` -> a/b.py, a/c.py."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _names(body: List[ast.stmt]) -> dict:
    """Names a module or class body defines (def, class, assignment, import), by name ->
    the node (a def's or class's; else None); under top-level if/try/with too."""
    out: dict = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out.setdefault(alias.asname or alias.name.split(".")[0], None)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                for name, value in _names(block).items():
                    out.setdefault(name, value)
    return out


def _arity(fn: ast.AST) -> Tuple[int, Optional[int]]:
    """(required, most) positional arguments of a def (``self``/``cls`` of a method aside)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) - len(a.defaults), None if a.vararg else len(positional)


def _member(node: Optional[ast.AST], rest: List[str], what: str, args: Optional[str]) -> Optional[str]:
    """What is wrong with ``rest`` (members below a class) and ``args`` of the thing reached."""
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return None  # below an instance or a value: not followed
        found = _names(node.body)
        if part not in found:
            return f"{what}: {node.name} has no {part}"
        node = found[part]
    if args is not None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        given = len([x for x in args.split(",") if x.strip()])
        low, high = _arity(node)
        if given < low or (high is not None and given > high):
            most = "any" if high is None else high
            return f"{what}: {node.name} takes {low}-{most} positional arguments, the page gives {given}"
    return None


def check_module(dotted: str, attr: Optional[str] = None, args: Optional[str] = None,
                 whole: Optional[str] = None) -> Optional[str]:
    """What is wrong with a dotted citation (``pkg.mod.name``; ``pkg.mod:attr``), or None."""
    what = whole or dotted
    parts = dotted.split(".")
    here = REPO / parts[0]
    i = 1
    while i < len(parts) and here.is_dir():
        if (here / parts[i]).is_dir():
            here = here / parts[i]
        elif (here / f"{parts[i]}.py").is_file():
            here = here / f"{parts[i]}.py"
        else:
            break
        i += 1
    module = here / "__init__.py" if here.is_dir() else here
    rest = parts[i:] + (attr.split(".") if attr else [])
    if attr and i < len(parts):
        return f"{what}: no module {'.'.join(parts[:i + 1])}"
    if not rest:
        return None
    if not module.is_file():
        return f"{what}: no module {'.'.join(parts[:i + 1])}" if i < len(parts) else f"{what}: {here} has no {rest[0]}"
    found = _names(_tree(module).body)
    if rest[0] not in found:
        return f"{what}: {module.relative_to(REPO)} defines no {rest[0]}"
    return _member(found[rest[0]], rest[1:], what, args)


def check_key(key: str) -> Optional[str]:
    """What is wrong with a config key (``cluster.nodes``), or None: each part a field."""
    parts = key.split(".")
    if parts[0] in FREE_FORM:
        return None
    cls: typing.Any = RunConfig
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return f"{key}: the config has no {'.'.join(parts[:depth + 1])} ({cls.__name__}'s fields: spec/)"
        hint = typing.get_type_hints(cls)[part]
        if typing.get_origin(hint) is typing.Union:  # Optional[X]: X
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        cls = hint
        if not dataclasses.is_dataclass(cls):
            return None if depth == len(parts) - 1 or typing.get_origin(cls) is dict or cls is typing.Any else \
                f"{key}: {'.'.join(parts[:depth + 1])} is a value, it has no {parts[depth + 1]}"
    return None


def _package_name(parts: List[str]) -> bool:
    """Whether ``train.X``/``launcher.X`` names the package's X (else: a config key)."""
    root = REPO / parts[0]
    if (root / f"{parts[1]}.py").is_file() or (root / parts[1]).is_dir():
        return True
    return parts[1] in _names(_tree(root / "__init__.py").body)


def check_word(word: str) -> Optional[str]:
    """What is wrong with one word of a code span, if it is a citation of this project."""
    word = word.rstrip(",;")
    if word in NOT_REPO_PATHS or any(c in word for c in "*<>[]|$"):
        return None
    m = PATH.match(word)
    if m:
        return check_path(m.group("path"), m.group("ref"), word)
    if "=" in word:
        key, _, value = word.lstrip("+").partition("=")
        if MODULE_FN.match(value) and value.split(".")[0].split(":")[0] in PACKAGES:
            problem = check_word(value)
            if problem:
                return problem
        if "." in key and key.split(".")[0] in SECTIONS:  # an override: the key is the config's
            return check_key(key)
        return check_word(key) if "." in key else None
    m = DOTTED.match(word)
    if not m:
        return None
    name, attr, args = m.group("name"), m.group("attr"), m.group("args")
    parts = name.split(".")
    if not attr and parts[-1] in FILE_SUFFIXES:
        return None
    top = parts[0]
    if top in PACKAGES and (top not in SECTIONS or attr or _package_name(parts)):
        return check_module(name, attr, args, word)
    if top in SECTIONS and not attr and args is None:
        return check_key(name)
    return None


def check_path(path: str, ref: Optional[str], word: str) -> Optional[str]:
    for p in expand(path):
        target = REPO / p
        if p.endswith("/") and not target.is_dir():
            return f"{word}: no directory {p}"
        if not target.exists():
            return f"{word}: no {p}"
        if ref is None:
            continue
        lines = re.fullmatch(r"(\d+)(?:-(\d+))?", ref)
        if lines:
            need = int(lines.group(2) or lines.group(1))
            have = len(target.read_text().splitlines())
            if need > have:
                return f"{word}: {p} has {have} lines"
        elif p.endswith(".py"):
            module = ".".join(Path(p).with_suffix("").parts)
            problem = check_module(module, ref, None, word)
            if problem:
                return problem
    return None


def check_span(code: str) -> List[str]:
    """The problems of one code span: ``python -m M`` names a module; each word is checked."""
    problems = []
    code = PATH_REF.sub(r"\1:", code)  # "spec/cluster.py: ClusterConfig" is one citation
    m = re.match(r"python3? -m ([\w.]+)", code)
    if m and m.group(1).split(".")[0] in PACKAGES:
        mod = m.group(1)
        target = REPO.joinpath(*mod.split("."))
        if not (target.with_suffix(".py").is_file() or (target / "__main__.py").is_file()):
            problems.append(f"{code}: python -m {mod}: no module to run")
        code = code[m.end():]
    for word in code.split():
        problem = check_word(word)
        if problem:
            problems.append(problem)
    return problems


def drifts(text: str, page: str = "page") -> List[str]:
    return [f"{page}:{line}: {problem}" for line, code in spans(text) for problem in check_span(code)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_what_a_page_cites_exists(page: Path) -> None:
    found = drifts(page.read_text(), str(page.relative_to(REPO)))
    assert not found, "\n".join(found)


def test_the_check_finds_what_drifted() -> None:
    """Planted wrong citations are each reported; the right ones beside them are not."""
    wrong = ["`train/no_such.py`", "`docs/architecture.md:99999`", "`docs/nothing/`", "`launcher.plan.no_such`",
             "`train.loop:no_such`", "`train.no_such_key`", "`launcher.no_such_key=1`", "`cluster.no_such`",
             "`spec/config.py: NoSuch`", "`launcher.plan.gate.check_fits(cfg)`", "`python -m launcher.nothing`",
             "`entrypoint=train.doctor:nothing`", "`launcher/{status,nothing}.py`", "`train.strategies.base.Engine.nope`", "`train.loop=1`",
             "`checkpoint.every_steps.x`", "`spec.no_module.x`"]
    right = ["`train/loop.py`", "`docs/architecture.md:3-5`", "`conf/cluster/`", "`launcher.plan.gate.check_fits(cfg, layout)`",
             "`train.doctor:check`", "`train.steps=4`", "`launcher.dry_run=true`", "`cluster.nodes`", "`+cluster=local`",
             "`spec/config.py: RunConfig`", "`python -m launcher.resume RUN_DIR cluster.nodes=1`", "`train.bin`",
             "`entrypoint=train.doctor:check`", "`launcher/{status,cancel}.py`", "`train.strategies.pp`",
             "`train.strategies.base.Engine.train_step`", "`user.lr=3e-4`", "`slurm.conf`", "`spec.config.RunConfig`",
             "`model.rope_scaling.factor`", "`cluster.env`"]
    for citation in wrong:
        assert drifts(f"text {citation} text"), citation
    page = "A line " + ", ".join(right) + ".\n\n```bash\npython -m launcher train/no_such.py\n```\n"
    assert drifts(page) == []
    assert len(drifts("\n".join(wrong))) == len(wrong)
    assert drifts("x\n`train/none.py`")[0].startswith("page:2: ")
