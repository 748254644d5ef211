"""One registry type for every kind of algorithm entry (losses, advantage estimators, reward
shapings, group filters, token masks, controllers): a name maps to one entry, and the name is
then a value the config accepts.

    ESTIMATORS = Registry("advantage estimator", takes=1)
    ESTIMATORS.add("grpo", RegisteredEstimator(grpo, ...), grpo)   # usually via a decorator
    ESTIMATORS.lookup("grpo")     # the entry; an unknown name lists the known ones
    list(ESTIMATORS)              # the names, in registration order

A name registered twice is refused, with both definitions named (file and line), so that a
plugin cannot silently replace a built-in entry or another plugin's; registering the same
definition again (its module executed a second time) replaces it. A function that cannot be
called with the registry's `takes` positional arguments is refused when it is registered,
not when the run first calls it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """A registration that cannot stand: a name taken by another definition, or a function
    that does not take what its registry passes."""


def definition(fn: Callable) -> str:
    """Where `fn` is defined: `module.qualname (file:line)`, as far as Python knows."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        lines, line = inspect.getsourcelines(fn)
        return f"{name} ({inspect.getsourcefile(fn)}:{line})"
    except (OSError, TypeError):
        return name


class Registry(Mapping[str, T], Generic[T]):
    """Names -> entries of one kind (`what`, for messages); each entry registered through a
    function called with `takes` positional arguments (checked when it is added)."""

    def __init__(self, what: str, takes: int):
        self.what, self.takes = what, takes
        self._entries: dict[str, T] = {}
        self._definitions: dict[str, str] = {}

    def add(self, name: str, entry: T, fn: Callable) -> None:
        """Register `entry` under `name`; `fn` is the function it was made from."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.what} needs a non-empty name, got {name!r}")
        where = definition(fn)
        self._check_signature(name, fn, where)
        if name in self._entries and self._definitions[name] != where:
            raise RegistryError(
                f"{self.what} {name!r} is registered twice: by {self._definitions[name]} and "
                f"by {where}; give one of them another name"
            )
        self._entries[name] = entry
        self._definitions[name] = where

    def _check_signature(self, name: str, fn: Callable, where: str) -> None:
        if not callable(fn):
            raise RegistryError(f"{self.what} {name!r} ({where}) is not callable")
        try:
            inspect.signature(fn).bind(*range(self.takes))
        except TypeError as error:
            raise RegistryError(
                f"{self.what} {name!r} ({where}) must take {self.takes} positional "
                f"argument{'s' if self.takes != 1 else ''}; its signature is "
                f"{inspect.signature(fn)} ({error})"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): taken as it is

    def lookup(self, name: str) -> T:
        """The entry `name`; an unknown name is an error that lists the known ones."""
        if name not in self._entries:
            raise ValueError(f"{self.what} {name!r} is not one of {', '.join(self._entries)}")
        return self._entries[name]

    def where(self, name: str) -> str:
        """Where the entry `name` was defined (`definition`)."""
        return self._definitions[name]

    def remove(self, name: str) -> None:
        """Forget `name` (a test's own entry, once the test is done)."""
        del self._entries[name]
        del self._definitions[name]

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"
