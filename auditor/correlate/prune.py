"""Forgetting from the front of a dict kept in the order its entries were last touched."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def drop_front(entries: dict[K, V], gone: Callable[[V], bool]) -> list[tuple[K, V]]:
    """Remove the entries from the first on while ``gone(value)``, and return them. Tables whose
    entries move to the end when touched are in about time order, so a pass costs what it removes;
    an entry behind a kept one waits for a later pass."""
    expired: list[tuple[K, V]] = []
    for key, value in entries.items():
        if not gone(value):
            break
        expired.append((key, value))
    for key, _ in expired:
        del entries[key]
    return expired
