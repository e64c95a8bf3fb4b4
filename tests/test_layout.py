"""The package's layout holds: layers import only downwards, no import cycle (imports inside functions
included), no module imports another's private name, no module much over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rayspec"
LAYERS = ("rayspec.errors", "rayspec.targets", "rayspec.core", "rayspec.data", "rayspec.models", "rayspec.partition", "rayspec.config",
          "rayspec.exec", "rayspec.exec.ray", "rayspec.training", "rayspec.cli")
"""Bottom first: a module may import from its own layer and the layers before it (docs/layout.md)."""
ENTRY = {"rayspec", "rayspec.train", "rayspec.tune", "rayspec.study", "rayspec.schedule"}
"""The package's front door and the ``python -m`` entry points: above every layer."""
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import of a ``rayspec`` module in ``path``, at any
    depth (inside functions too); ``from pkg import sub`` counts as an import of ``pkg.sub`` when it is one."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "rayspec"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "rayspec":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in known else (base, alias.name, node.lineno))
    return out


def layer(module: str) -> int:
    if module in ENTRY:
        return len(LAYERS)
    return max(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


def graph() -> dict[str, set[str]]:
    """Who imports whom. A module's import of its own package (a registry's ``register``, which the package
    imports its modules to fill) is its package's business, not an edge, as Python runs the package first."""
    mods = modules()
    known = set(mods)
    return {name: {target for target, _, _ in imports(path, name, known)
                   if target in known and target != name and not name.startswith(target + ".")}
            for name, path in mods.items()}


def test_layers_import_only_downwards():
    mods = modules()
    known = set(mods)
    wrong = [f"{name}:{line} imports {target} (a higher layer)"
             for name, path in mods.items() for target, _, line in imports(path, name, known)
             if target in known and layer(target) > layer(name)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_a_private_name():
    mods = modules()
    known = set(mods)
    private = [f"{name}:{line} imports {target}.{what}" for name, path in mods.items()
               for target, what, line in imports(path, name, known)
               if what is not None and what.startswith("_") and target != name]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by idea (STYLE: one idea per module)"


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    """The analysis itself: a function-level import closing a cycle and a private name are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from rayspec.b import _hidden\n")
    b.write_text("def f():\n    import rayspec.a\n")
    known = {"rayspec.a", "rayspec.b"}
    assert imports(a, "rayspec.a", known) == [("rayspec.b", "_hidden", 1)]
    assert imports(b, "rayspec.b", known) == [("rayspec.a", None, 2)]
