"""Architecture: the package's import graph has no cycle, and the core holds no tool code."""

from __future__ import annotations

import ast
from pathlib import Path

import embstore

ROOT = Path(__file__).resolve().parent.parent
# the folders setup.cfg maps under the one import name `embstore`
PACKAGES = {"embstore": ROOT / "embstore", "embstore.backends": ROOT / "backends",
            "embstore.policies": ROOT / "policies", "embstore.tools": ROOT / "tools"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            rel = file.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name in PACKAGES and folder != PACKAGES[name]:
                continue  # e.g. embstore/backends would shadow the mapped folder
            found[name] = file
    return found


def _imports(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (lazily too)."""
    is_package = file.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target in modules:
                out.add(target)
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_of_the_package_has_no_cycle() -> None:
    modules = _modules()
    assert "embstore.store" in modules and "embstore.backends.dram" in modules
    graph = {name: _imports(name, file, modules) for name, file in modules.items()}
    # a submodule's `from embstore import x` names the package: its __init__ imports the
    # core, so only imports of the package's own modules count, not of the package itself
    for name in graph:
        if name != "embstore":
            graph[name].discard("embstore")
    assert graph["embstore.checkpoint"], "the walker found no import at all"
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None



def test_the_core_package_holds_no_tool_code() -> None:
    core = {p.stem for p in Path(embstore.__file__).parent.glob("*.py")}
    assert not core & {"simulate", "traces", "workload"}
