"""The trainer's callbacks (rayspec/training/callbacks.py): typed hooks, checked when registered, called in order."""

from __future__ import annotations

import pytest
import torch

import rayspec
from rayspec.errors import ConfigError
from rayspec.training.callbacks import HOOKS, Callback, Callbacks


class Recorder(Callback):
    """Records the hooks a run calls; the hooks it leaves out do nothing (``Callback``'s)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_start(self, config) -> None:
        self.calls.append("start")

    def on_metrics(self, record) -> None:
        self.calls.append("val" if "val_accuracy" in record else "loss")

    def on_weights(self, step, state) -> None:
        self.calls.append(f"weights {step}")

    def on_end(self, summary) -> None:
        self.calls.append("end" if summary is not None else "failed")


class Misspelt:
    def on_metric(self, record) -> None:  # on_metrics
        pass


def test_a_misspelt_hook_is_refused_when_registered(tmp_path):
    with pytest.raises(ConfigError, match="Misspelt has a method on_metric, which is no hook; did you mean on_metrics"):
        Callbacks([Recorder(), Misspelt()])
    x = torch.randn(32, 6)
    with pytest.raises(ConfigError, match="on_metric, which is no hook"):  # before the run starts
        rayspec.fit([torch.nn.Linear(6, 2)], (x, (x[:, 0] > 0).long()), stages=1, run_dir=tmp_path / "run",
                    callbacks=[Misspelt()], executor="local")
    assert not (tmp_path / "run").exists()


def test_a_hook_must_be_a_method_and_other_names_are_free():
    class Flag:
        on_end = True

    with pytest.raises(ConfigError, match="Flag: on_end is a bool; a hook must be a method"):
        Callbacks([Flag()])

    class Helpers:
        on_time = 3  # not a method: not a hook either
        def _on_private(self) -> None: ...
        def report(self) -> None: ...

    assert Callbacks([Helpers()]).wants("on_end") is False


def test_the_dispatcher_calls_each_hook_on_the_callbacks_that_have_it_in_order():
    seen: list[str] = []

    class First:
        def on_metrics(self, record) -> None:
            seen.append(f"first {record['step']}")

    class Second:
        def on_metrics(self, record) -> None:
            seen.append(f"second {record['step']}")

        def on_restart(self, index, record) -> None:
            seen.append(f"restart {index} {record['kind']}")

    callbacks = Callbacks([First(), Second()])
    callbacks.on_metrics({"step": 1})
    callbacks.on_restart(0, {"kind": "stage"})
    callbacks.on_end(None)  # no callback has it: nothing happens
    assert seen == ["first 1", "second 1", "restart 0 stage"]
    assert Callbacks.of(callbacks) is callbacks and list(callbacks) == list(callbacks[:2])
    assert (callbacks.wants("on_restart"), callbacks.wants("on_weights")) == (True, False)
    assert HOOKS == ("on_resume", "on_start", "on_metrics", "on_weights", "on_restart", "on_end")


def test_a_run_calls_the_hooks_in_order(tmp_path):
    recorder = Recorder()
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    data = (x, (x[:, 0] > 0).long())
    rayspec.fit([torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)], data, data, stages=2, run_dir=tmp_path,
                executor="local", callbacks=[recorder], max_steps=4, batch_size=16, log_every=2)
    assert recorder.calls == ["start", "loss", "loss", "weights 4", "val", "end"]
