"""A model and data of one's own: ``model._target_`` and ``data._target_`` builders, what counts as a list of
blocks, and the errors that name the target and what was expected (rayspec/targets.py, models/custom.py,
data/custom.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from rayspec.config import ConfigError, from_mapping
from rayspec.config.compose import compose
from rayspec.data import DataBundle, DataError, DataInfo
from rayspec.data.custom import as_dataset, build_target_data
from rayspec.models import ModelError
from rayspec.models.custom import as_blocks, build_target_model
from rayspec.training import run

SEEN: dict[str, object] = {}


def blocks(width: int = 16, depth: int = 3, info: DataInfo | None = None) -> list[nn.Module]:
    """A builder that asks for the data's DataInfo: ``depth`` blocks for its images and classes."""
    SEEN["info"] = info
    assert info is not None
    inputs = int(torch.tensor(info.input_shape).prod())
    first = nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), nn.ReLU())
    return [first] + [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 2)] + [
        nn.Linear(width, info.num_classes)]


def plain(width: int = 8) -> nn.Sequential:
    """A builder that takes no DataInfo (it is not passed one)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(48, width), nn.ReLU(), nn.Linear(width, 3))


def not_a_model() -> dict:
    return {"layers": 3}


def points(n: int = 256, seed: int = 0, noise: float = 0.1):
    """A data builder: 3 classes of 4x4x3 images, a validation split and their DataInfo."""
    SEEN["seed"] = seed
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (n,), generator=g)
    x = y.float().view(-1, 1, 1, 1).expand(n, 3, 4, 4) + noise * torch.randn(n, 3, 4, 4, generator=g)
    return TensorDataset(x[: n // 2], y[: n // 2]), TensorDataset(x[n // 2 :], y[n // 2 :]), DataInfo(
        "image", 3, (3, 4, 4))


def float_labels():
    return (torch.randn(8, 2), torch.randn(8)), None, None


class Net(nn.Module):
    def __init__(self, stray: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)])
        if stray:
            self.head = nn.Linear(2, 2)


def test_what_counts_as_a_list_of_blocks():
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    seq = nn.Sequential(*layers)
    assert as_blocks(seq, "x") is seq
    for given in (layers, tuple(layers), nn.ModuleList(layers)):
        got = as_blocks(given, "x")
        assert isinstance(got, nn.Sequential) and list(got) == layers
    net = Net()
    got = as_blocks(net, "x")
    assert list(got) == list(net.blocks) and got[0] is net.blocks[0]  # the same modules: trained in place
    with pytest.raises(ModelError, match=r"x returned a Net with parameters or buffers outside its blocks \(head.weight"):
        as_blocks(Net(stray=True), "x")
    with pytest.raises(ModelError, match="x returned a builtins.dict; expected an nn.Sequential of blocks"):
        as_blocks({"a": 1}, "x")
    with pytest.raises(ModelError, match="holding a int, not only modules"):
        as_blocks([nn.ReLU(), 3], "x")
    with pytest.raises(ModelError, match="returned no blocks"):
        as_blocks([], "x")


def test_a_model_target_gets_its_keys_and_the_data_info():
    info = DataInfo("image", 5, (3, 4, 4))
    model = build_target_model({"_target_": f"{__name__}.blocks", "width": 8, "depth": 4}, info)
    assert len(model) == 4 and model[-1].out_features == 5 and SEEN["info"] is info
    assert len(build_target_model({"_target_": f"{__name__}.plain"}, info)) == 4  # takes no info: gets none


def test_a_model_target_that_does_not_fit_is_named():
    info = DataInfo("image", 3, (3, 4, 4))
    with pytest.raises(ModelError, match=r"model._target_=nowhere.build cannot be imported"):
        build_target_model({"_target_": "nowhere.build"}, info)
    with pytest.raises(ModelError, match=rf"model._target_={__name__}.plain cannot be called with the model config's "
                                         r"keys \(height\).*height"):
        build_target_model({"_target_": f"{__name__}.plain", "height": 3}, info)
    with pytest.raises(ModelError, match=rf"model._target_={__name__}.not_a_model returned a builtins.dict; expected "
                                         "an nn.Sequential of blocks, an nn.ModuleList or list of blocks"):
        build_target_model({"_target_": f"{__name__}.not_a_model"}, info)
    with pytest.raises(ModelError, match="model.info is passed by rayspec"):
        build_target_model({"_target_": f"{__name__}.blocks", "info": 1}, info)


def test_a_data_target_gets_its_keys_and_the_seed():
    data = build_target_data({"_target_": f"{__name__}.points", "n": 64}, seed=7)
    assert isinstance(data, DataBundle) and len(data.train) == 32 and SEEN["seed"] == 7
    assert data.info == DataInfo("image", 3, (3, 4, 4))
    with pytest.raises(DataError, match=rf"data._target_={__name__}.plain returned a torch.nn.modules.container."
                                        r"Sequential; expected a DataBundle or a tuple \(train, val, info\)"):
        build_target_data({"_target_": f"{__name__}.plain"}, seed=0)
    with pytest.raises(DataError, match=r"\(train\): labels must be integer class ids \(the loss is cross-entropy\)"):
        build_target_data({"_target_": f"{__name__}.float_labels"}, seed=0)


def test_data_sets_are_checked_on_their_first_item():
    x, y = torch.randn(10, 2), torch.arange(10)
    assert isinstance(as_dataset((x, y), "d"), TensorDataset)
    with pytest.raises(DataError, match="d: 10 inputs but 9 labels"):
        as_dataset((x, y[:9]), "d")
    with pytest.raises(DataError, match=r"d: its items must be \(input, label\) pairs, but item 0 is a tuple of 1"):
        as_dataset(TensorDataset(x), "d")
    with pytest.raises(DataError, match="d is a builtins.int; expected a map-style data set"):
        as_dataset(3, "d")


def test_config_takes_a_target_or_a_name_not_both():
    config = from_mapping(compose(["model=custom", f"model._target_={__name__}.blocks", "+model.width=8"]))
    assert config.model == {"_target_": f"{__name__}.blocks", "width": 8} and config.model_name == f"{__name__}.blocks"
    with pytest.raises(ConfigError, match="model._target_=x.y and model.name=mlp are both set .* pick model=custom"):
        from_mapping(compose(["+model._target_=x.y"]))
    with pytest.raises(ConfigError, match="model._target_='\\?\\?\\?' must be the dotted path of a builder"):
        from_mapping(compose(["model=custom"]))
    smoke = from_mapping(compose(["model=custom", f"model._target_={__name__}.blocks", "debug=smoke"]))
    assert "size" not in smoke.model  # debug=smoke sets model.size only where the model's config has one


def test_a_run_trains_a_model_and_data_of_ones_own(tmp_path):
    """``model._target_`` and ``data._target_`` through the trainer: the summary names them; a model of rayspec's
    own needs the data's DataInfo, which the data target gives."""
    overrides = ["model=custom", f"model._target_={__name__}.blocks", "+model.depth=4", "data=custom",
                 f"data._target_={__name__}.points", "pipeline.executor=local", "pipeline.stages=2",
                 "train.max_steps=6", "train.batch_size=16", "train.log_every=3"]
    summary = run(overrides, tmp_path / "own")
    assert (summary.model, summary.dataset, summary.model_size) == (f"{__name__}.blocks", f"{__name__}.points", None)
    assert summary.updates == 6 and summary.val_accuracy is not None
    assert json.loads((tmp_path / "own" / "summary.json").read_text())["balance"] == [2, 2]
    registry = ["model=mlp", "model.size=tiny", *overrides[3:]]
    assert run(registry, tmp_path / "mlp").model == "mlp"
