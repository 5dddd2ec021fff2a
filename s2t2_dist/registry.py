"""One registry type for every "name -> implementation" table of the project: translator kinds, engine kinds,
optimisers, input formats, commands and the stages' config classes.

A Registry is a dict (so `Literal[tuple(R)]`, `name in R` and iteration work as for any mapping) that adds:

- ``register(name)``: a decorator (or ``register(name, entry)``) that refuses a name twice;
- ``lookup(name, key)``: the entry, or a ConfigError naming the config ``key`` and the registered names;
- ``load(name, key)``: for entries written as ``"module:attribute"`` strings, the attribute, imported only when
  asked for (DeepSpeed, transformers and the stages load only when used).
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

T = TypeVar("T")


class Registry(dict):
    def __init__(self, what: str, entries: dict[str, Any] | None = None):
        super().__init__()
        #: what the entries are, for messages ("engine kind", "optimiser")
        self.what = what
        for name, entry in (entries or {}).items():
            self.register(name, entry)

    def register(self, name: str, entry: Any = None) -> Any:
        """Add ``entry`` under ``name``; without ``entry``, a decorator that adds what it decorates."""
        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self[name] = obj
            return obj

        return add if entry is None else add(entry)

    def lookup(self, name: str, key: str = "") -> Any:
        """The entry registered as ``name``; a ConfigError naming ``key`` (the config key that chose it) otherwise."""
        if name not in self:
            from s2t2_dist.errors import ConfigError

            where = f"{key}: " if key else ""
            raise ConfigError(f"{where}{name!r} is not a registered {self.what}; choose from {', '.join(sorted(self))}")
        return self[name]

    def load(self, name: str, key: str = "") -> Any:
        """The object a ``"module:attribute"`` entry names, imported now."""
        module, _, attr = self.lookup(name, key).partition(":")
        return getattr(importlib.import_module(module), attr)
