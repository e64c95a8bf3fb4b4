"""rayspec as a user installs it: a wheel built from the checkout, installed (not editable) into a fresh virtual
environment, runs ``python -m rayspec.train``, ``python -m rayspec.tune`` and the ``rayspec`` script from a directory
outside the checkout, with the Hydra configs, sweeps and studies that ship inside the package and a config directory
of one's own.

The new environment gets its dependencies (torch, Ray, ...) from the interpreter running this test, through a
``.pth`` file naming a folder of links to that interpreter's site-packages, less any rayspec there; so nothing is
downloaded, and the rayspec that runs is the installed wheel's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dependencies(into: Path) -> Path:
    """``into``: a link to every entry of this interpreter's site-packages except rayspec's own."""
    into.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("rayspec", "__editable__")) or name.endswith(".pth"):
            continue
        (into / entry.name).symlink_to(entry)
    return into


def _source(into: Path) -> Path:
    """A copy of the checkout's files (tracked, and new ones git does not ignore): the build writes ``build/`` and
    ``*.egg-info`` into the tree it builds, which must be neither the checkout nor stale."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def _install(tmp: Path) -> tuple[Path, dict[str, str]]:
    """Build the wheel, make the environment, install the wheel; its python and an environment for commands."""
    dist = tmp / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist),
                            str(_source(tmp / "src"))], capture_output=True, text=True, timeout=600, env=env)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    wheel = next(dist.glob("rayspec-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "rayspec_dependencies.pth").write_text(f"{_dependencies(tmp / 'deps')}\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True, timeout=600, env=env)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0")
    return python, env


USER_FILES = {
    "mymodels.py": '''
        """A user's own model: blocks for any image data set."""
        import math
        from torch import nn

        def build(info, width=16, depth=4):
            inputs = math.prod(info.input_shape)
            hidden = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 2)]
            return [nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), nn.ReLU()), *hidden,
                    nn.Linear(width, info.num_classes)]
    ''',
    "myconf/model/mine.yaml": '''
        _target_: mymodels.build
        width: 12
    ''',
    "sweep.yaml": '''
        overrides: [debug=smoke, pipeline.executor=local, pipeline.stages=2, model=mine]
        search_space:
          optim.lr: {grid: [0.01, 0.05]}
        max_concurrent_trials: 1
    ''',
}


@pytest.mark.slow  # a wheel, an environment, four runs and a 2-trial sweep: 2-3 minutes on 2 busy cores
def test_the_installed_wheel_runs_outside_the_checkout(tmp_path):
    python, env = _install(tmp_path)
    work = tmp_path / "work"
    for name, text in USER_FILES.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(textwrap.dedent(text).lstrip())

    def run(*args: str, timeout: float = 600, command: Path = python) -> subprocess.CompletedProcess:
        res = subprocess.run([str(command), *args], env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{args}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        return res

    where = run("-c", "import rayspec, rayspec.config.compose as c; print(rayspec.__file__); print(c.CONF)")
    package, conf = where.stdout.split()
    assert Path(package).is_relative_to(tmp_path / "venv") and not Path(package).is_relative_to(ROOT)
    shipped = Path(package).parent / "experiments"
    assert (Path(conf) / "config.yaml").is_file() and (shipped / "sweeps" / "lr_method.yaml").is_file()
    assert (shipped / "studies" / "lstm_text.yaml").is_file()

    run("-m", "rayspec.train", "debug=smoke", "pipeline.executor=local", "hydra.run.dir=runs/smoke")
    assert json.loads((work / "runs/smoke/summary.json").read_text())["updates"] == 4

    run("-m", "rayspec.train", "--config-dir", "myconf", "model=mine", "debug=smoke", "pipeline.executor=local",
        "hydra.run.dir=runs/mine")
    mine = json.loads((work / "runs/mine/summary.json").read_text())
    assert mine["model"] == "mymodels.build" and mine["config"]["model"] == {"_target_": "mymodels.build", "width": 12}

    script = python.parent / "rayspec"  # the console script: rayspec COMMAND is python -m rayspec.COMMAND
    assert "available studies: fashion, lstm_rt, lstm_text" in run("study", "--help", command=script).stdout
    run("train", "debug=smoke", "pipeline.executor=local", "hydra.run.dir=runs/script", command=script)
    assert json.loads((work / "runs/script/summary.json").read_text())["updates"] == 4

    searchpath = f"hydra.searchpath=[file://{work / 'myconf'}]"
    run("-m", "rayspec.train", searchpath, "model=mine", "debug=smoke", "pipeline.executor=local",
        "hydra.run.dir=runs/searchpath")
    assert (work / "runs/searchpath/summary.json").exists()

    sweep = run("-m", "rayspec.tune", "sweep=sweep.yaml", "storage_path=sweeps", "ray.num_cpus=1", searchpath)
    assert "Ray: started a local instance with 1 CPUs" in sweep.stdout + sweep.stderr
    rows = (work / "sweeps" / "sweep" / "sweep_results.csv").read_text().splitlines()
    assert len(rows) == 3 and all("TERMINATED" in row for row in rows[1:]), rows
    shutil.rmtree(tmp_path / "deps")  # links only; the interpreter's own site-packages stay as they are
