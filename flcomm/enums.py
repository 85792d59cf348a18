"""The one way flcomm turns user input into one of its modes.

Every mode is a ``str`` :class:`Choice` (``ReduceOp``, ``Outer``, ``InnerState``, ``Strategy``),
so it compares equal to its value and prints as it was typed::

    class Outer(Choice, what="outer"):
        AVG = "avg"
        NESTEROV = "nesterov"

    Outer.parse("Nesterov") is Outer.NESTEROV
    Outer.parse("sgd")        # ValueError: outer must be one of avg, nesterov, got 'sgd'

This module imports nothing from flcomm: every layer may use it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """A mode given by name. Subclasses name the setting for error messages with the class
    keyword ``what`` and may override :meth:`_missing_value` to accept other spellings."""

    def __init_subclass__(cls, what: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._setting = what or cls.__name__

    @classmethod
    def parse(cls: type[C], value: Any) -> C:
        """``value`` as a member: a member, or its value in any case; ValueError naming the
        setting, the allowed values and what came otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(cls._normalize(value))
            except ValueError:
                pass
        found = cls._missing_value(value)
        if found is not None:
            return found
        raise ValueError(f"{cls._setting} must be one of {', '.join(m.value for m in cls)}, got {value!r}")

    @classmethod
    def _normalize(cls, text: str) -> str:
        return text.strip().lower()

    @classmethod
    def _missing_value(cls: type[C], value: Any) -> C | None:
        return None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    def __str__(self) -> str:
        return self.value
