"""The shape of the house (DESIGN.md), checked on the source text so it cannot drift:

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
  on the lines just above its ``def`` says why.

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
