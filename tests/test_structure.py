"""The shape of the house (docs/architecture.md), checked on the source text so it cannot drift:

- imports run one way: ``launcher -> spec, slurm``; ``train -> spec, slurm``; ``spec``
  imports nothing but the standard library and omegaconf/hydra; ``slurm`` imports neither
  side; ``train`` never imports ``launcher`` (lazy imports inside functions count too);
- no import circle among the project's modules, imports inside functions included (a lazy
  import hides a circle from Python, not from the reader);
- rooms do not point back at their parent: a room (a package inside ``launcher``,
  ``train``, ...) uses only its parent's ground modules, those that import none of the
  parent's rooms (``train.model``, ``launcher.compose``), never the ones above the rooms
  (``launcher.launch``, ``train.main``), functions included;
- no source module over 400 lines, no function over 60 lines unless a ``# long:`` comment
  on the lines just above its ``def`` says why;
- private names of torch, DeepSpeed, Hydra, omegaconf, submitit and transformers are used
  only in their fences (:data:`FENCES`), each use a small function there that says why
  (:func:`test_private_third_party_names_stay_in_their_fences` says what it cannot see).

Pure: reads files with ``ast``, imports nothing of the project.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOMS = ("spec", "slurm", "launcher", "train")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> Dict[str, Path]:
    out = {}
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, top_level_only: bool) -> Iterator[str]:
    """Absolute names a module imports (``from a.b import c`` yields a.b.c when it is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module-level code, including under if/try (TYPE_CHECKING blocks excluded)
        nodes = [n for stmt in tree.body if not _is_type_checking(stmt) for n in ast.walk(stmt)
                 if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 and not _inside_function(stmt, n)]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    yield f"{node.module}.{alias.name}"


def _is_type_checking(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)


def _inside_function(stmt: ast.stmt, node: ast.AST) -> bool:
    for fn in ast.walk(stmt):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and fn is not node:
            if any(child is node for child in ast.walk(fn)):
                return True
    return False


ALLOWED = {
    "spec": {"spec", "omegaconf", "hydra"},
    "slurm": {"slurm", "spec", "submitit"},
    "launcher": {"launcher", "spec", "slurm", "hydra", "omegaconf", "yaml", "submitit", "rich", "matplotlib", "numpy"},
}
FORBIDDEN = {"train": {"launcher"}}


@pytest.mark.parametrize("room", ROOMS)
def test_imports_run_one_way(room: str) -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name, path in MODULES.items():
        if name.split(".")[0] != room:
            continue
        for imported in set(_imports(path, top_level_only=False)):
            top = imported.split(".")[0]
            if room in ALLOWED and top not in ALLOWED[room] | stdlib:
                bad.append(f"{path.relative_to(REPO)} imports {imported}")
            if top in FORBIDDEN.get(room, ()):
                bad.append(f"{path.relative_to(REPO)} imports {imported}")
    assert not bad, "\n".join(sorted(bad))


def _graph() -> Dict[str, Set[str]]:
    """module -> the project's modules it imports anywhere (functions included).

    A package's __init__ is imported with each of its submodules: an edge from a module to
    its own package is what Python does, not a circle in the code."""
    return {name: {i for i in _imports(path, top_level_only=False)
                   if i in MODULES and i != name and not name.startswith(i + ".")}
            for name, path in MODULES.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[Tuple[str, ...]]:
    cycles: List[Tuple[str, ...]] = []
    state: Dict[str, int] = {}

    def visit(node: str, stack: List[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(tuple(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def test_no_import_circle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _room_of(name: str) -> Optional[str]:
    """The room (a package below a top-level one: ``launcher.track``) a module is in."""
    parts = name.split(".")
    room = ".".join(parts[:2])
    return room if len(parts) > 2 or (len(parts) == 2 and MODULES[name].name == "__init__.py") else None


def _back_pointers(graph: Dict[str, Set[str]]) -> List[str]:
    """Imports from a room into its parent's modules that import a room of that parent
    (directly or through other modules of the parent)."""
    def above_rooms(module: str, seen: Set[str]) -> bool:
        seen.add(module)
        for dep in graph[module]:
            if _room_of(dep) is not None and dep.startswith(module.split(".")[0] + "."):
                return True
            if _room_of(dep) is None and dep not in seen and above_rooms(dep, seen):
                return True
        return False

    bad = []
    for name, deps in sorted(graph.items()):
        room = _room_of(name)
        if room is None:
            continue
        for dep in sorted(deps):
            parent = room.rsplit(".", 1)[0]
            if _room_of(dep) is None and dep.startswith(parent + ".") and above_rooms(dep, set()):
                bad.append(f"{name} -> {dep} (room {room} points back at its parent {parent})")
    return bad


def test_rooms_do_not_point_back() -> None:
    bad = _back_pointers(_graph())
    assert not bad, "\n".join(bad)


def test_modules_are_small() -> None:
    big = [f"{p.relative_to(REPO)}: {n} lines" for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(big)


def test_functions_are_short_or_say_why() -> None:
    long = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = node.end_lineno - first + 1
            above = lines[max(0, first - 3):first - 1]
            if size > MAX_FUNCTION_LINES and not any(line.strip().startswith("# long:") for line in above):
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {size} lines")
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines without a '# long: why' comment above:\n"
                      + "\n".join(long))


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The scanners see what they look for (a check that finds nothing proves nothing)."""
    src = tmp_path / "m.py"
    src.write_text("import torch\n\ndef f():\n    from launcher import app\n")
    assert {"torch", "launcher"} <= set(_imports(src, top_level_only=False))
    assert set(_imports(src, top_level_only=True)) == {"torch"}
    assert len(MODULES) > 40 and "spec.config" in MODULES and "train.strategies" in MODULES
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [("a", "b", "a")]
    back = {"launcher.track.status": {"launcher.launch", "launcher.overrides"}, "launcher.overrides": set(),
            "launcher.launch": {"launcher.track.status"}}
    assert _back_pointers(back) == ["launcher.track.status -> launcher.launch (room launcher.track points back "
                                    "at its parent launcher)"]


# ---- private third-party names: one fence a side ----------------------------------------

THIRD_PARTY = {"torch", "deepspeed", "hydra", "omegaconf", "submitit", "transformers"}
# Where the rule holds: the project's code, its tests and benchmarks. Not examples/: users'
# code, which imports nothing of the project (it could not call a fence).
PRIVATE_SCOPE = ("train", "launcher", "spec", "slurm", "hydra_plugins", "bench", "tests")
FENCES = {
    "train/torch_compat.py": "the compute side's (torch, DeepSpeed)",
    "launcher/compat.py": "the login side's (Hydra, omegaconf; hydra_plugins imports it too)",
    "slurm/submitit_adapter.py": "submitit's, the one adapter over it (login side and the batch script)",
}
# (file, private name as the scanner spells it): why that file reaches it itself.
PRIVATE_EXCEPTIONS = {
    ("tests/test_submitit_adapter.py", "submitit.slurm.slurm._make_sbatch_string"):
        "pins the submitit fence's private pieces, so that an upgrade fails this test, not a job",
    ("tests/test_submitit_adapter.py", "submitit.slurm.slurm._convert_mem"):
        "pins the submitit fence's private pieces, so that an upgrade fails this test, not a job",
    ("tests/test_torch_compat.py", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"):
        "the torch fence's own test: hides the private module to see the fence name what is missing",
    ("tests/test_step_costs.py", "torch.distributed._broadcast_coalesced"):
        "counts DDP's calls of this private collective: what DDP calls is what the test measures",
    ("tests/test_step_costs.py", "torch._dynamo"):
        "makes dynamo's recompiles errors (torch._dynamo.config.error_on_recompile) to see a block compile once",
}
_PRIVATE_IMPORTERS = {"import_module", "__import__", "find_spec", "patch", "setattr", "delattr"}
_ATTR_BUILTINS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_module(text: object) -> Optional[str]:
    """``text`` when it is a dotted name in a third-party package with a private part."""
    if not isinstance(text, str) or text.split(".")[0] not in THIRD_PARTY:
        return None
    parts = text.split(".")
    return text if all(p.isidentifier() for p in parts) and any(_private(p) for p in parts) else None


def _const(node: ast.AST) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _is_sys_modules(node: ast.AST) -> bool:
    return ast.unparse(node) == "sys.modules"


def _bound_by_lookup(value: ast.AST) -> Optional[str]:
    """The module a ``sys.modules.get("x")`` / ``sys.modules["x"]`` / ``import_module("x")`` /
    ``__import__("x")`` expression names, when it is a third-party one."""
    name, called = None, None
    if isinstance(value, ast.Subscript) and _is_sys_modules(value.value):
        name = _const(value.slice)
    elif isinstance(value, ast.Call) and value.args:
        func = value.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (called == "get" and isinstance(func, ast.Attribute) and _is_sys_modules(func.value)) \
                or called in ("import_module", "__import__"):
            name = _const(value.args[0])
    if not isinstance(name, str) or name.split(".")[0] not in THIRD_PARTY:
        return None
    return name.split(".")[0] if called == "__import__" else name  # __import__("a.b") returns a


def _third_party_names(tree: ast.AST) -> Dict[str, str]:
    """Names bound anywhere in a module to a third-party module or object -> its dotted name:
    by an import, a lookup (:func:`_bound_by_lookup`) or an alias (``base = deepspeed.zero.Init``)."""
    names: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in THIRD_PARTY:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                        else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in THIRD_PARTY:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for _ in range(2):  # an alias of an alias
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound = _bound_by_lookup(node.value) or _dotted(node.value, names)
                if bound and (node.targets[0].id not in names or names[node.targets[0].id] == bound):
                    names[node.targets[0].id] = bound
    return names


def _dotted(node: ast.AST, names: Dict[str, str]) -> Optional[str]:
    """``torch.cuda.memory`` for an attribute chain rooted at a third-party name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id]] + parts[::-1])
    return None


def _no_private_part(dotted: Optional[str]) -> bool:
    return dotted is not None and not any(_private(p) for p in dotted.split("."))


def _private_uses(source: str) -> List[Tuple[int, str]]:
    """(line, name) of each use of a private third-party name in ``source``: imports,
    attributes of names bound to those packages, get/set/has/delattr with a private
    name, and module names handed to importlib, ``sys.modules`` or a patcher."""
    tree = ast.parse(source)
    names = _third_party_names(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name) for a in node.names if _private_module(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in THIRD_PARTY:
            if _private_module(node.module):
                found.add((node.lineno, node.module))
            found |= {(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(a.name)}
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = _dotted(node.value, names)
            if _no_private_part(base):  # the first private part of a chain, once
                found.add((node.lineno, f"{base}.{node.attr}"))
        elif isinstance(node, ast.ClassDef):  # a private method defined on a third-party class
            for base in filter(_no_private_part, (_dotted(b, names) for b in node.bases)):
                found |= {(item.lineno, f"{base}.{item.name}") for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name)
                          and not item.name.startswith("__")}  # __x is mangled: the class's own
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and _private_module(_const(node.slice)):
            found.add((node.lineno, _const(node.slice)))
        elif isinstance(node, ast.Compare) and any(_is_sys_modules(c) for c in node.comparators) \
                and _private_module(_const(node.left)):
            found.add((node.lineno, _const(node.left)))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = _const(node.args[0])
            if called in _ATTR_BUILTINS and isinstance(func, ast.Name) and len(node.args) >= 2 \
                    and isinstance(_const(node.args[1]), str) and _private(_const(node.args[1])):
                base = _dotted(node.args[0], names)
                if _no_private_part(base):
                    found.add((node.lineno, f"{base}.{_const(node.args[1])}"))
            if called in _PRIVATE_IMPORTERS and _private_module(first):
                found.add((node.lineno, first))
            if called in ("get", "pop", "setdefault") and isinstance(func, ast.Attribute) \
                    and _is_sys_modules(func.value) and _private_module(first):
                found.add((node.lineno, first))
            if called in ("setitem", "delitem") and _is_sys_modules(node.args[0]) and len(node.args) >= 2 \
                    and _private_module(_const(node.args[1])):
                found.add((node.lineno, _const(node.args[1])))
    return sorted(found)


def _private_files() -> Dict[str, Path]:
    return {str(p.relative_to(REPO)): p for room in PRIVATE_SCOPE for p in sorted((REPO / room).rglob("*.py"))}


def test_private_third_party_names_stay_in_their_fences() -> None:
    """A private name of torch, DeepSpeed, Hydra, omegaconf, submitit or transformers is used
    only in :data:`FENCES` (and as :data:`PRIVATE_EXCEPTIONS` says, each with why).

    Seen: ``import torch._dynamo``, ``from hydra._internal.x import y``, ``from torch.x import
    _y``; an attribute chain from a name bound to those packages (``torch._foreach_copy_``,
    ``torch.cuda.memory._dump_snapshot``, ``dist._broadcast_coalesced`` with ``import
    torch.distributed as dist``, ``c10d._world`` with ``from torch.distributed import
    distributed_c10d as c10d``, ``Module._x`` with ``from torch.nn import Module``); the
    same through ``getattr``/``setattr``/``hasattr``/``delattr`` with a constant name; names
    bound by ``x = sys.modules.get("torch")`` / ``sys.modules["torch"]`` /
    ``importlib.import_module("torch.x")`` / ``__import__("torch")`` or an alias (``base =
    deepspeed.zero.Init``); a private method defined in a subclass of such a name (it
    overrides the base's, or may: ``class X(base): def _zero_init_param``; name a helper of
    one's own without the underscore, or ``__x``); a constant module name
    given to ``import_module``, ``__import__``, ``find_spec``, ``mock.patch`` /
    ``monkeypatch.setattr`` / ``delattr``, or used as a ``sys.modules`` key.

    Not seen: private attributes of values rather than names (``engine.optimizer._x``,
    ``mesh._flatten`` on a mesh passed in, ``type(x)._y``, anything after a call or a
    subscript); names bound otherwise (parameters, other assignments, loop targets);
    a computed attribute name (``getattr(torch, name)``); module names built at run time
    (f-strings, concatenation) or in text (the batch script's ``-m submitit.core._submit``);
    non-Python files. Bindings are per file, not per scope (a name imported in one function
    counts in all: this can only over-report)."""
    bad = []
    used_exceptions = set()
    for rel, path in _private_files().items():
        if rel in FENCES:
            continue
        for line, name in _private_uses(path.read_text()):
            if (rel, name) in PRIVATE_EXCEPTIONS:
                used_exceptions.add((rel, name))
            else:
                bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("private third-party names outside their fences (add a function with a docstring to "
                     + ", ".join(FENCES) + " and call it):\n" + "\n".join(bad))
    stale = sorted(set(PRIVATE_EXCEPTIONS) - used_exceptions)
    assert not stale, f"PRIVATE_EXCEPTIONS names uses that are gone (remove them): {stale}"
    assert all(path in _private_files() for path in FENCES), FENCES


def test_the_private_name_check_can_fail() -> None:
    """The scanner sees each kind of use it claims to, and passes clean code."""
    planted = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch._dynamo\n"
        "import sys, importlib\n"
        "from hydra._internal.core_plugins.basic_sweeper import BasicSweeper\n"
        "from omegaconf import _utils\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "def f(monkeypatch):\n"
        "    torch._foreach_copy_([], [])\n"
        "    torch.cuda.memory._dump_snapshot('x')\n"
        "    dist.distributed_c10d._world\n"
        "    getattr(c10d, '_world', None)\n"
        "    t = sys.modules.get('torch')\n"
        "    t._C._distributed_c10d\n"
        "    importlib.import_module('transformers._x')\n"
        "    monkeypatch.setitem(sys.modules, 'deepspeed._y', None)\n"
        "    monkeypatch.setattr('submitit.core._submit.main', None)\n"
        "    base = torch.nn.Module\n"
        "    class M(base):\n"
        "        def _apply(self, fn):\n"
        "            return self.__x()\n"
        "        def __x(self):\n"
        "            base._version\n"
    )
    assert _private_uses(planted) == [
        (3, "torch._dynamo"), (5, "hydra._internal.core_plugins.basic_sweeper"), (6, "omegaconf._utils"),
        (9, "torch._foreach_copy_"), (10, "torch.cuda.memory._dump_snapshot"),
        (11, "torch.distributed.distributed_c10d._world"), (12, "torch.distributed.distributed_c10d._world"),
        (14, "torch._C"), (15, "transformers._x"), (16, "deepspeed._y"), (17, "submitit.core._submit.main"),
        (20, "torch.nn.Module._apply"), (23, "torch.nn.Module._version")]
    clean = ("import torch\nimport torch.distributed as dist\nfrom . import _x\n"
             "class A:\n    def f(self, engine, mesh):\n        self._x = torch.__version__\n"
             "        dist.init_process_group('gloo')\n        return engine._y, mesh._flatten, _x._z\n"
             "s = '-m submitit.core._submit'\n")
    assert _private_uses(clean) == []
    assert {"train/torch_compat.py", "tests/test_mesh.py", "hydra_plugins/sto_sweep/sto_sweep.py"} \
        <= set(_private_files())
