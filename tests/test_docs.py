"""The documentation: generated pages equal what their scripts write, the site builds strictly, the README stays
short and its commands and example run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _python(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``cwd`` with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def test_generated_pages_equal_what_the_generators_write(tmp_path):
    """docs/results/*.md come from benchmarks/results (``docs.gen_results``) and docs/configuration.md from the config
    code (``docs.gen_config``), never by hand. One process writes both (its imports cost more than the writing)."""
    code = ("import sys; from pathlib import Path; from docs import gen_config, gen_results; "
            "gen_results.write(Path(sys.argv[1])); gen_config.write(Path(sys.argv[2]))")
    res = _python(["-c", code, str(tmp_path / "results"), str(tmp_path / "configuration.md")], ROOT)
    assert res.returncode == 0, res.stderr
    written = sorted(p.name for p in (tmp_path / "results").glob("*.md"))
    assert written == sorted(p.name for p in (DOCS / "results").glob("*.md")), "a result page is missing or extra"
    for name in [*(f"results/{n}" for n in written), "configuration.md"]:
        assert (tmp_path / name).read_text() == (DOCS / name).read_text(), \
            f"docs/{name} differs from what its generator writes: run `make docs` and commit it"


def test_the_site_builds_strictly(tmp_path):
    """A broken link or anchor, or a page left out of mkdocs.yml's nav, fails the build."""
    res = _python(["-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                   "--site-dir", str(tmp_path / "site")], ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert not list((tmp_path / "site").rglob("*.py")), "a generator script was published with the site"


def test_the_strict_build_fails_on_a_page_left_out_of_the_nav(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# a\n\n[b](b.md#there)\n")
    (docs / "b.md").write_text("# b\n\n## there\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[0] + "\nnav:\n  - index.md\n"
    (tmp_path / "mkdocs.yml").write_text(config)
    res = _python(["-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], tmp_path)
    assert res.returncode != 0 and "b.md" in res.stdout + res.stderr


def test_readme_is_short_and_names_the_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci and "make test" in text and "make demo" in text
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page in [README, *_pages()]:
        for target in re.findall(r"`make ([\w-]+)`|^make ([\w-]+)", page.read_text(), re.M):
            assert (target[0] or target[1]) in targets, f"{page.name}: make {target} is not a Makefile target"


def _module_exists(module: str) -> bool:
    """A module or package of this checkout (``rayspec.train``, ``benchmarks.peer``, ``docs.gen_results``), else an
    installed one (``mkdocs``)."""
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").exists() or base.is_dir():
        return True
    return importlib.util.find_spec(module) is not None


def test_every_module_the_docs_run_exists():
    """Each ``python -m MODULE`` shown in the README or the docs names a module of this checkout or its deps."""
    missing = []
    for page in [README, *_pages()]:
        for module in set(re.findall(r"python -m ([A-Za-z_][\w.]*)", page.read_text())):
            if not any(part.isupper() for part in module.split(".")) and not _module_exists(module):  # not NAME
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
    assert not missing, missing


def test_every_link_of_the_readme_resolves():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which does not exist"


def test_readme_fit_example_runs(tmp_path):
    """The README's Python example trains as shown (the local executor: no Ray)."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    res = _python(["-c", code.group(1)], tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (tmp_path / "outputs" / "fit-example" / "summary.json").exists()
