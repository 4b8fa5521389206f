"""Name -> object registries (attention families, init schemes, tasks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from lra_cond.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """A small name registry whose lookup error lists the valid names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._items[name] = obj

    def remove(self, name: str) -> T:
        """Unregister ``name`` (e.g. a family a test defined); returns what was registered."""
        return self._items.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UserError(
                f"unknown {self.kind} '{name}'; valid {self.kind}s: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
