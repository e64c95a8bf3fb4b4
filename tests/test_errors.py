"""One error family (rayspec/errors.py): every error for input that cannot work is a ``RayspecError``, and an
unknown name is a ``ConfigError`` wherever it is looked up."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

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


def test_an_unknown_name_is_a_config_error_everywhere():
    from rayspec.config import PipelineConfig
    from rayspec.core.optim import Optimizer, OptimSpec
    from rayspec.core.schedule import build_schedule
    from rayspec.data import build_data
    from rayspec.models import build_model
    from rayspec.partition import choose_partition

    with pytest.raises(ConfigError, match=r"pipeline.method='spectrian' is unknown; choose one of .*spectrain.* "
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
    assert str(unknown("x", 3, ["a"])) == "x=3 is unknown; choose one of a"
