"""The trainer's callbacks: the ``Callback`` hooks a run calls, and ``Callbacks``, which checks them when they are
registered (a misspelt hook is an error) and calls each hook on every callback that has it."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, overload

from rayspec.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rayspec.config import Config

__all__ = ["Callback", "Callbacks", "HOOKS"]


class Callback(Protocol):
    """What a run tells its callbacks, in order: ``on_resume`` (only when it resumes from a checkpoint),
    ``on_start``, then ``on_metrics`` for every record, ``on_weights`` at every evaluation and ``on_restart`` after
    every restart, and ``on_end``. A callback implements any of the hooks (subclass ``Callback`` for hooks that
    do nothing by default); a public method named ``on_*`` that is no hook is refused when the callback is
    registered. With ``pipeline.executor=ray`` the run loop runs in a driver actor and the hooks run in the
    calling process, on what it streams back (``rayspec.training.driver``).
    """

    def on_resume(self, step: int, checkpoint: Path | str | None) -> None:
        """Before ``on_start``, when the run resumes from the checkpoint at ``checkpoint``, after update ``step``."""

    def on_start(self, config: Config) -> None:
        """The run starts with ``config`` (as run: with ``logger.id`` set for W&B)."""

    def on_metrics(self, record: dict[str, Any]) -> None:
        """A record written to ``metrics.jsonl``: per-update ``loss`` records and per-evaluation ``val_*`` ones."""

    def on_weights(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """The merged weights evaluated after update ``step`` (pipeline methods, at every evaluation)."""

    def on_restart(self, index: int, record: dict[str, Any]) -> None:
        """A restart after a failure is done; ``record`` is ``summary.json``'s ``restarts[index]``."""

    def on_end(self, summary: dict[str, Any] | None) -> None:
        """The run ended with ``summary`` (``summary.json``'s mapping), or failed: ``None``."""


HOOKS = ("on_resume", "on_start", "on_metrics", "on_weights", "on_restart", "on_end")
"""The hooks of ``Callback``, in the order a run calls them."""


class Callbacks(Sequence[Any]):
    """The callbacks of one run, checked: each hook of ``Callback`` as a method that calls it on every callback
    that has it, in the order given.

    Args:
        callbacks: objects with any of the hooks (``Callback``); a ``Callbacks`` is taken as it is.

    Raises:
        ConfigError: a callback has a public ``on_*`` method that is no hook (a misspelt hook), naming the hooks.
    """

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self._items = tuple(callbacks)
        for cb in self._items:
            if not isinstance(cb, Callbacks):
                check(cb)
        self._hooks: dict[str, list[Callable[..., None]]] = {
            hook: [fn for cb in self._items if (fn := getattr(cb, hook, None)) is not None] for hook in HOOKS
        }

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    @classmethod
    def of(cls, callbacks: Iterable[Any]) -> Callbacks:
        """``callbacks`` as they are when they are a ``Callbacks`` already, else checked."""
        return callbacks if isinstance(callbacks, Callbacks) else cls(callbacks)

    def wants(self, hook: str) -> bool:
        """Whether any callback has ``hook`` (a run sends the weights only to ``on_weights``)."""
        return bool(self._hooks[hook])

    def on_resume(self, step: int, checkpoint: Path | str | None) -> None:
        for fn in self._hooks["on_resume"]:
            fn(step, checkpoint)

    def on_start(self, config: Config) -> None:
        for fn in self._hooks["on_start"]:
            fn(config)

    def on_metrics(self, record: dict[str, Any]) -> None:
        for fn in self._hooks["on_metrics"]:
            fn(record)

    def on_weights(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        for fn in self._hooks["on_weights"]:
            fn(step, state)

    def on_restart(self, index: int, record: dict[str, Any]) -> None:
        for fn in self._hooks["on_restart"]:
            fn(index, record)

    def on_end(self, summary: dict[str, Any] | None) -> None:
        for fn in self._hooks["on_end"]:
            fn(summary)


def check(callback: Any) -> None:
    """Refuse ``callback`` when it has a public method named ``on_*`` that is no hook, or a hook that cannot be
    called; the message names it, the closest hook and all hooks."""
    who = type(callback).__qualname__
    for name in dir(callback):
        if not name.startswith("on_"):
            continue
        value = getattr(callback, name, None)
        if name in HOOKS and not callable(value):
            raise ConfigError(f"callback {who}: {name} is a {type(value).__name__}; a hook must be a method")
        if name not in HOOKS and callable(value):
            close = difflib.get_close_matches(name, HOOKS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"callback {who} has a method {name}, which is no hook; {hint}"
                              f"the hooks are {', '.join(HOOKS)}")
