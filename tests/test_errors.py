"""One error family (rayspec/errors.py): every error for input that cannot work is a ``RayspecError``, and an
unknown name is a ``ConfigError`` wherever it is looked up."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import yaml

import rayspec
from rayspec.core.methods import method
from rayspec.errors import ConfigError, RayspecError, unknown

PACKAGE = Path(rayspec.__file__).resolve().parent
FAILURES = {"rayspec.training.dataparallel.DataParallelError"}
"""Error classes for a run that failed (a worker's error), not for what a user gave: ``RuntimeError``s."""


def error_classes() -> list[str]:
    """Every ``class ...Error`` defined in the package, as ``module.Name``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out += [f"{'.'.join(parts)}.{node.name}" for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    return out


@pytest.mark.parametrize("name", error_classes())
def test_every_error_for_bad_input_is_a_rayspec_error(name):
    module, cls = name.rsplit(".", 1)
    error = getattr(importlib.import_module(module), cls)
    if name in FAILURES:
        assert issubclass(error, RuntimeError) and not issubclass(error, RayspecError)
    else:
        assert issubclass(error, RayspecError) and issubclass(error, ValueError)


def test_the_seven_and_run_failed_are_exported():
    names = {"ConfigError", "DataError", "ModelError", "PartitionError", "ScheduleError", "StudyError", "SweepError"}
    assert names <= {n.rsplit(".", 1)[1] for n in error_classes()}
    assert (rayspec.RayspecError, rayspec.ConfigError) == (RayspecError, ConfigError)
    assert issubclass(rayspec.RunFailed, RuntimeError) and not issubclass(rayspec.RunFailed, RayspecError)
    assert {"RunSummary", "Callback", "RayspecError", "ConfigError", "RunFailed"} <= set(rayspec.__all__)


def test_an_unknown_name_is_a_config_error_everywhere(tmp_path):
    from rayspec.cli.schedule import parse_args as schedule_args
    from rayspec.cli.study import runner_options
    from rayspec.cli.study_config import load_study
    from rayspec.cli.sweep import load_sweep
    from rayspec.config import PipelineConfig
    from rayspec.core.optim import Optimizer, OptimSpec
    from rayspec.core.schedule import build_schedule
    from rayspec.core.stage_spec import StageSpec
    from rayspec.data import build_data
    from rayspec.models import build_model
    from rayspec.partition import choose_partition

    with pytest.raises(ConfigError, match=r"pipeline.method='spectrian' is unknown; choose one of .*spectrain, .* "
                                          r"\(did you mean 'spectrain'\?\)"):
        method("spectrian")
    with pytest.raises(ConfigError, match="pipeline.method='spectrian' is unknown"):
        PipelineConfig(method="spectrian")
    with pytest.raises(ConfigError, match="pipeline.method='hogwild' is unknown"):
        build_schedule("1f1b", 2, 2).differences("hogwild", "paper")
    with pytest.raises(ConfigError, match=r"model='vgg61' is unknown; .*\(did you mean 'vgg16'\?\)"):
        build_model("vgg61", None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="data='svhn' is unknown"):
        build_data("svhn")
    with pytest.raises(ConfigError, match="pipeline.partition='fastest' is unknown"):
        choose_partition(None, 2, "fastest")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optim.name='lamb' is unknown"):
        Optimizer([], OptimSpec(name="lamb"))
    with pytest.raises(ConfigError, match=r"schedule='1f1c' is unknown; .*\(did you mean '1f1b'\?\)"):
        build_schedule("1f1c", 2, 2)
    with pytest.raises(ConfigError, match="variant='papr' is unknown; choose one of paper, consistent"):
        build_schedule("1f1b", 2, 2).version_differences("papr")
    for setting in ({"policy": "lookahead"}, {"backward": "twice"}, {"precision": "fp16"}, {"predictor": "quadratic"},
                    {"clip_scope": "layer"}):
        with pytest.raises(ConfigError, match=f"{next(iter(setting))}=.* is unknown; choose one of"):
            StageSpec(**setting)
    with pytest.raises(ConfigError, match="sweep='nope' is unknown in .*; choose one of lr_method"):
        load_sweep("nope")
    with pytest.raises(ConfigError, match="study='nope' is unknown in .*; choose one of fashion, lstm_rt"):
        load_study("nope")
    with pytest.raises(ConfigError, match="runner='slurm' is unknown"):
        runner_options({"runner": "slurm"})
    with pytest.raises(ConfigError, match="schedule='zigzag' is unknown"):
        schedule_args(["schedule=zigzag"])
    sweep_file = tmp_path / "sweep.yaml"
    for settings, message in [({"search_space": {"optim.lr": {"normal": [0, 1]}}}, "domain='normal' is unknown"),
                              ({"scheduler": "hyperband"}, "scheduler='hyperband' is unknown"),
                              ({"search_alg": "bayes"}, "search_alg='bayes' is unknown")]:
        sweep_file.write_text(yaml.safe_dump({"search_space": {"optim.lr": {"grid": [0.1]}}, **settings}))
        with pytest.raises(ConfigError, match=message):
            load_sweep(str(sweep_file))
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump({"methods": ["spectrian-paper"]}))
    with pytest.raises(ConfigError, match=r"method='spectrian-paper' is unknown in study study; .*\(did you mean "
                                          r"'spectrain-paper'\?\)"):
        load_study(str(study_file))
    assert str(unknown("x", 3, ["a"])) == "x=3 is unknown; choose one of a"
