"""Classes chosen by name: queue policies (`policies.py`) and routing policies (`routing.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

C = TypeVar("C")


class Registry(Generic[C]):
    """Classes by name. `@registry.register("name")` records a class and sets its `name`;
    a second class under a name already taken is refused (the same class again is not)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[C]] = {}

    def register(self, name: str) -> Callable[[type[C]], type[C]]:
        def wrap(cls: type[C]) -> type[C]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"a {self.kind} named {name!r} is already registered")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return wrap

    def alias(self, name: str, cls: type[C]) -> None:
        """`cls` also under `name` (another project's name for it); its own `name` stays."""
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"a {self.kind} named {name!r} is already registered")
        self._classes[name] = cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __getitem__(self, name: str) -> type[C]:
        return self._classes[name]
