"""Credentials that never show: :class:`Secret`, below the settings so every layer can hold one.

Settings (:mod:`raydeck.config.settings`), the stack's connection file, the stack's credentials and
the Grafana client carry their passwords and keys as ``Secret``; ``repr``/``str`` print
``'********'`` and :meth:`Secret.reveal` is the only way to the value.
"""

from __future__ import annotations


class Secret:
    """A credential. Shows as ``'********'`` everywhere; ``reveal()`` is the only way in."""

    __slots__ = ("_value",)

    def __init__(self, value: str = "") -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret('********')" if self._value else "Secret('')"

    __str__ = __repr__
