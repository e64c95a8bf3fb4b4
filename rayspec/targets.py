"""A user's own builder named by ``_target_`` in a config section: import it and call it with the section's keys.

``model._target_=mypkg.models.build`` and ``data._target_=mypkg.data.build`` name such builders (Hydra's
``_target_`` convention, ``hydra.utils.instantiate``). The section's other keys become the call's keyword
arguments; rayspec adds what it knows (the data's ``DataInfo`` as ``info``, the run's ``seed``) only where the
builder has a parameter of that name, so a builder takes only what it needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rayspec.errors import ConfigError

__all__ = ["TARGET", "call_target"]

TARGET = "_target_"
"""The key that names a builder by its dotted import path."""


def call_target(section: str, cfg: Mapping[str, Any], error: type[Exception] = ConfigError, **given: Any) -> Any:
    """Call the builder ``cfg["_target_"]`` with ``cfg``'s other keys, plus those of ``given`` it has parameters for.

    Args:
        section: the config section, for messages (``model``, ``data``).
        cfg: the section: ``_target_`` and the builder's keyword arguments (Hydra's ``_args_``, ``_convert_`` and
            nested ``_target_`` objects work as in ``hydra.utils.instantiate``).
        error: the exception type raised for a target that cannot be imported or called with these keys.
        given: what rayspec passes when the builder asks for it by name (``info=``, ``seed=``).

    Raises:
        ``error`` naming the target: it cannot be imported, or its parameters do not match the section's keys.
        Exceptions raised inside the builder itself pass through unchanged.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = cfg[TARGET]
    clash = sorted(set(cfg) & set(given))
    if clash:
        raise error(f"{section}.{clash[0]} is passed by rayspec to {section}._target_={target}; "
                    f"remove {section}.{clash[0]} from the {section} config")
    try:  # Hydra resolves the target and the nested objects; rayspec's own arguments are added below
        partial = instantiate({**cfg, "_partial_": True, "_convert_": "all"})
    except InstantiationException as err:
        raise error(f"{section}._target_={target} cannot be imported or prepared ({err}); give the dotted path of "
                    "a function or class importable here and on every Ray node, e.g. mypkg.models.build") from err
    func = getattr(partial, "func", partial)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass only the configured keys
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in given.items() if takes_any or k in params}
    if params:
        try:
            inspect.signature(func).bind(*getattr(partial, "args", ()), **getattr(partial, "keywords", {}), **extra)
        except TypeError as err:
            keys = ", ".join(sorted(k for k in cfg if k != TARGET)) or "none"
            raise error(f"{section}._target_={target} cannot be called with the {section} config's keys ({keys}): "
                        f"{err}; make the {section} config's keys match its parameters") from err
    return partial(**extra)
