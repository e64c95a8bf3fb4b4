"""The benchmarks' runner: ``python -m benchmarks list`` and ``python -m benchmarks run NAME [--quick] [ARGS...]``.

A benchmark is a folder of this package with a ``bench.py`` whose ``main(argv)`` parses the benchmark's own
options; ``NAME`` is the folder (``memory``). Another module of the folder with a ``main`` is an entry too,
named ``folder.module`` (``memory.plot``, ``studies.lr``). ``run`` passes every argument after ``NAME`` through,
so ``python -m benchmarks run peer --quick --transports p2p`` is ``python -m benchmarks.peer --quick
--transports p2p``. A ``--quick`` run writes its results to a scratch folder (``benchmarks._shared.results``),
never over the committed ones in ``benchmarks/results/``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
USAGE = "usage: python -m benchmarks list\n       python -m benchmarks run NAME [--quick] [ARGS...]"
ENTRY = "bench"
"""The module of a benchmark's folder that ``python -m benchmarks.NAME`` runs."""


def _docstring_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _has_main(path: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body)


def entries() -> dict[str, tuple[str, str]]:
    """Every runnable entry: name -> (module, one-line description), read from the files without importing them.

    A benchmark's description is its folder's ``__init__`` docstring; another entry's, its module's."""
    found: dict[str, tuple[str, str]] = {}
    for folder in sorted(p for p in HERE.iterdir() if p.is_dir() and (p / f"{ENTRY}.py").is_file()):
        if folder.name.startswith("_"):
            continue
        found[folder.name] = (f"benchmarks.{folder.name}.{ENTRY}", _docstring_line(folder / "__init__.py"))
        for module in sorted(folder.glob("*.py")):
            if module.stem.startswith("_") or module.stem == ENTRY or not _has_main(module):
                continue
            found[f"{folder.name}.{module.stem}"] = (f"benchmarks.{folder.name}.{module.stem}", _docstring_line(module))
    return found


def run(name: str, argv: Sequence[str]) -> int:
    """Run entry ``name`` in this process with ``argv`` as its command line; its exit status."""
    known = entries()
    if name not in known:
        raise SystemExit(f"benchmark {name!r} is unknown; choose one of: {', '.join(known)} (python -m benchmarks list)")
    module = importlib.import_module(known[name][0])
    saved, sys.argv = sys.argv, [f"python -m benchmarks run {name}", *argv]  # what argparse's usage lines name
    try:
        return int(module.main(list(argv)) or 0)
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["list"] and len(args) == 1:
        known = entries()
        width = max(len(name) for name in known)
        for name, (_, line) in known.items():
            print(f"{name.ljust(width)}  {line}")
        return 0
    if args[:1] == ["run"] and len(args) >= 2:
        return run(args[1], args[2:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
