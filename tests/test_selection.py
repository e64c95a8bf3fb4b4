"""The selection split (rayspec/data/selection.py) of Fashion-MNIST and the CSV text sets, on small files in the real
formats: held-out samples are never trained on, the test split is untouched, and bad settings are refused."""

from __future__ import annotations

import pytest
import torch
from test_data import rt_rows, write_csv, write_mnist

from rayspec.data import DataError, build_data
from rayspec.data.selection import split_indices


def test_split_indices_fixed_disjoint_and_complete():
    kept, held = split_indices("x", 5, 20)
    assert len(held) == 5 and len(kept) == 15
    assert sorted(torch.cat([kept, held]).tolist()) == list(range(20))
    assert torch.equal(held, split_indices("x", 5, 20)[1])  # fixed: every run seed selects on the same samples
    assert len(split_indices("x", 0.25, 20)[1]) == 5  # a share


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist"])
def test_mnist_selection_holds_out_training_images(tmp_path, name):
    x_train, y_train, x_test, _ = write_mnist(tmp_path, n_train=20, n_test=5)
    plain = build_data(name, root=str(tmp_path), augment=False)
    test = build_data(name, root=str(tmp_path), augment=False, selection=6)
    sel = build_data(name, root=str(tmp_path), augment=False, selection=6, eval_split="selection")
    assert (len(test.train), len(test.val), len(sel.train), len(sel.val)) == (14, 5, 14, 6)
    assert torch.equal(test.val.tensors[0], plain.val.tensors[0])  # the test split as without a selection
    assert torch.equal(sel.train.images, test.train.images)  # probes and final runs train on the same images
    _, held = split_indices(name, 6, 20)
    assert torch.equal(sel.val.tensors[1], torch.as_tensor(y_train[held.numpy()]))
    assert torch.equal(sel.val.tensors[0], plain.train.normalize(torch.as_tensor(x_train[held.numpy()],
                                                                                 dtype=torch.uint8).unsqueeze(1)))
    trained = {bytes(x.numpy()) for x in test.train.images}
    assert not trained & {bytes(x.numpy()) for x in torch.as_tensor(x_train[held.numpy()], dtype=torch.uint8)
                          .unsqueeze(1)}


def test_rt_reviews_selection_holds_out_whole_training_movies(tmp_path):
    path = write_csv(tmp_path / "rt.csv.bz2", rt_rows(movies=40, seed=2))
    plain = build_data("rt_reviews", path=str(path))
    test = build_data("rt_reviews", path=str(path), selection=0.25)
    sel = build_data("rt_reviews", path=str(path), selection=0.25, eval_split="selection")
    assert torch.equal(test.val.tensors[1], plain.val.tensors[1])  # the same validation movies
    assert len(test.train) + len(sel.val) == len(plain.train)
    assert abs(len(sel.val) - 0.25 * len(plain.train)) <= 6  # to within one movie (at most 6 reviews each)
    assert torch.equal(sel.train.tensors[0], test.train.tensors[0])
    # a held-out movie's name is outside the vocabulary (built from the rows trained on): whole movies held out
    assert (sel.val.tensors[0] == 1).sum(1).eq(1).all()


@pytest.mark.parametrize(("options", "match"), [
    ({"selection": -1}, "data.selection=-1 must be a share"),
    ({"selection": 1.5}, "data.selection=1.5 must be a share"),
    ({"selection": True}, "data.selection=True must be a share"),
    ({"eval_split": "val"}, "data.eval_split='val' must be one of test, selection"),
    ({"eval_split": "selection"}, "data.eval_split=selection needs a selection split"),
    ({"selection": 20}, "holds out 20 of the 20 training samples"),
])
def test_bad_selection_settings(tmp_path, options, match):
    write_mnist(tmp_path, n_train=20, n_test=5)
    with pytest.raises(DataError, match=match):
        build_data("fashion_mnist", root=str(tmp_path), **options)
