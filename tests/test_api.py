"""The Python entry points (rayspec/training/api.py, rayspec/config/settings.py): ``rayspec.fit`` trains blocks and
data sets of one's own with the trainer, on Ray as locally; ``rayspec.run`` takes a Config or overrides."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import yaml
from torch import nn

import rayspec
from rayspec.config import Config, ConfigError, OptimConfig, PipelineConfig
from rayspec.config.schema import SECTIONS
from rayspec.config.settings import FIELDS
from rayspec.models import ModelError
from rayspec.partition import PartitionError
from rayspec.training.summary import RunSummary


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes split by the sign of the first input."""
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] > 0).long()


def blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 2)]


SETTINGS = {"max_steps": 12, "batch_size": 16, "lr": 0.1, "log_every": 4, "eval_every": 6}


def test_fit_trains_the_blocks_in_place_and_writes_a_run(tmp_path):
    net = blocks()
    before = copy.deepcopy(nn.Sequential(*net).state_dict())
    summary = rayspec.fit(net, data(256, 0), data(64, 1), method="pipedream", stages=3, run_dir=tmp_path,
                          executor="local", **SETTINGS)
    assert (summary.method, summary.stages, summary.updates, summary.model) == ("pipedream", 3, 12, "blocks")
    assert summary.val_accuracy is not None and summary.balance == [1, 1, 1]
    assert summary.to_dict() == json.loads((tmp_path / "summary.json").read_text())  # key for key, in order
    assert list(summary.to_dict()) == list(json.loads((tmp_path / "summary.json").read_text()))
    assert RunSummary.read(tmp_path) == summary
    after = nn.Sequential(*net).state_dict()
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(after[k], saved[k]) for k in saved)  # the blocks hold the run's final weights
    assert any(not torch.equal(after[k], before[k]) for k in before)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_accuracy" in r] == [6, 12]
    config = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    assert config["optim"]["lr"] == 0.1 and config["model"]["blocks"] == 3
    again = rayspec.fit(nn.Sequential(*blocks()), data(256, 0), data(64, 1), method="pipedream", stages=3,
                        run_dir=tmp_path / "again", executor="local",
                        train={"max_steps": 12, "batch_size": 16, "log_every": 4, "eval_every": 6}, optim={"lr": 0.1})
    assert again.final_train_loss == summary.final_train_loss  # sections as mappings: the same run


def test_fit_on_ray_equals_fit_in_one_process(tmp_path, ray_session):
    """A driver actor and a Ray actor per stage give the local executor's weights exactly."""
    nets = {executor: blocks() for executor in ("local", "ray")}
    for executor, net in nets.items():
        rayspec.fit(net, data(128, 0), data(32, 1), stages=2, run_dir=tmp_path / executor, executor=executor,
                    cpus_per_stage=0.5, max_steps=6, batch_size=16, lr=0.1, log_every=3)
    local, ray = (nn.Sequential(*nets[e]).state_dict() for e in ("local", "ray"))
    assert all(torch.equal(local[k], ray[k]) for k in local)


def test_fit_names_what_does_not_fit(tmp_path):
    with pytest.raises(ConfigError, match="lrr=0.1 is not a setting; did you mean lr\\?"):
        rayspec.fit(blocks(), data(64, 0), run_dir=tmp_path, lrr=0.1)
    with pytest.raises(ConfigError, match="optim\\['rate'\\] is not a optim setting"):
        rayspec.fit(blocks(), data(64, 0), run_dir=tmp_path, optim={"rate": 0.1})
    with pytest.raises(ModelError, match="rayspec.fit\\(blocks\\) returned a builtins.str"):
        rayspec.fit("mlp", data(64, 0), run_dir=tmp_path)
    with pytest.raises(PartitionError, match="pipeline.stages=9 but the model has 3 blocks"):
        rayspec.fit(blocks(), data(64, 0), stages=9, run_dir=tmp_path, executor="local", batch_size=16)


def test_fit_takes_nested_settings_and_flat_ones_where_unambiguous(tmp_path, monkeypatch):
    nested = rayspec.fit(blocks(), data(128, 0), run_dir=tmp_path / "nested",
                         pipeline={"stages": 2, "executor": "local"}, optim={"lr": 0.1, "momentum": 0.5},
                         train={"max_steps": 4, "batch_size": 16, "log_every": 2})
    flat = rayspec.fit(blocks(), data(128, 0), run_dir=tmp_path / "flat", stages=2,
                       executor="local", lr=0.1, momentum=0.5, max_steps=4, batch_size=16, log_every=2)
    assert nested.config == flat.config and nested.final_train_loss == flat.final_train_loss
    assert (nested.stages, nested.config["optim"]["momentum"]) == (2, 0.5)
    with pytest.raises(ConfigError, match=r"optim.lr is given twice, as optim=\{'lr': ...\} and as lr=...; give it once"):
        rayspec.fit(blocks(), data(64, 0), run_dir=tmp_path / "x", optim={"lr": 0.1}, lr=0.2)
    with pytest.raises(ConfigError, match="optim.lr=-1 must be a positive number"):  # the section checks itself
        rayspec.fit(blocks(), data(64, 0), run_dir=tmp_path / "x", optim={"lr": -1})
    # Two sections may share a field name: as a flat keyword it is then refused, naming both.
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(FIELDS) == sorted(set(names)) and all(len(owners) == 1 for owners in FIELDS.values())
    monkeypatch.setitem(FIELDS, "every", ("checkpoint", "train"))
    with pytest.raises(ConfigError, match=r"every=5 is a field of the sections checkpoint and train; give it in its "
                                          r"section, e.g. checkpoint=\{'every': 5\}"):
        rayspec.fit(blocks(), data(64, 0), run_dir=tmp_path / "x", every=5)


def test_a_section_refuses_a_misspelt_attribute_and_checks_itself_where_it_is_made():
    config = Config()
    config.pipeline.stages = 2  # a field may be set (Config.validate checks it again) ...
    with pytest.raises(AttributeError, match="'PipelineConfig' object has no attribute 'stagse'"):
        config.pipeline.stagse = 2  # ... a misspelt one cannot: slots
    with pytest.raises(AttributeError, match="'Config' object has no attribute 'sed'"):
        config.sed = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="unexpected keyword argument 'stagse'"):
        PipelineConfig(stagse=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        OptimConfig("adam")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="optim.momentum=1.5 must be in"):
        OptimConfig(momentum=1.5)
    with pytest.raises(ConfigError, match="pipeline.stages=0 must be >= 1"):
        dataclasses.replace(config.pipeline, stages=0)


def test_run_takes_overrides_or_a_config(tmp_path):
    summary = rayspec.run(["debug=smoke", "pipeline.executor=local", "pipeline.stages=2"], tmp_path / "a")
    assert (summary.stages, summary.updates, summary.model_size) == (2, 4, "tiny")
    assert summary.to_dict() == json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (tmp_path / "a" / ".hydra" / "config.yaml").exists()
    config = Config()
    config.pipeline.executor, config.pipeline.stages, config.train.max_steps = "local", 2, 3
    config.train.train_samples, config.train.log_every = 256, 3
    assert rayspec.run(config, tmp_path / "b").updates == 3
    with pytest.raises(ConfigError, match=r"give a Config or a list of overrides, e\.g\. \['debug=smoke'\]"):
        rayspec.run("debug=smoke", tmp_path / "c")


def test_a_default_run_dir_is_hydras_layout(tmp_path, monkeypatch):
    from rayspec.training.api import new_run_dir

    monkeypatch.chdir(tmp_path)
    first = new_run_dir()
    first.mkdir(parents=True)
    second = new_run_dir()
    assert first.parts[0] == "outputs" and len(first.parts) == 3 and second != first
