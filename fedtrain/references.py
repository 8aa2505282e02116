"""`'package.module:Name'` references in configs: tasks, strategies, Flower apps.

Code is never shipped between machines: a config names code installed where it
runs (a pip-installed package, or a folder on PYTHONPATH), and every such name is
resolved here so a typo or a missing package reads the same wherever it appears.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedtrain.errors import ConfigError


def import_reference(ref: str, key: str, what: str = "Name") -> Any:
    """The object `ref` names; a `ConfigError` naming config key `key` otherwise.

    `what` says what the part after the colon should be ("ClassName", "function").
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {ref!r} must look like 'package.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key} = {ref!r}: cannot import {module_name!r} ({exc}); is it installed here? "
            "Install its package, or put the folder that holds it on PYTHONPATH"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{key} = {ref!r}: {module_name!r} has no {attr!r}")
    return obj
