"""Checkpoints of a long read over time, so that a round reads on from the last one instead of from
the start.

An in-flight zombie is judged every round, and two reads of its evidence grow with its age: its
cost window's integral (``waste.PartialCost``) and the sweep of its engine's scrapes since its
client left (``evidence.ScrapeSweep``). Read whole every round, they made a round's cost grow with
the zombie's age (bench/long_zombies.py; docs/footprint.md, thirtieth pass). Each keeps the read's
state at moments of the window; a round goes on from the last one that no news has touched. The
correlator drops, each round, those at or after the oldest moment its new evidence concerns
(spans, samples, scrapes, live notices), less a margin where the read's state depends on evidence a
little before it (``forget_from``), so what a round reads is what reading it all again would give.
``key``: what else the read depends on; another key starts it over.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

MAX_CHECKPOINTS = 64
State = TypeVar("State")


class Checkpoints(Generic[State]):
    """``(moment, state)`` pairs in time order, at least ``spacing_ns`` apart, at most
    MAX_CHECKPOINTS: past that, every other one of the older half goes (news seldom reaches far
    back, so the recent ones stay as close as they were taken)."""

    __slots__ = ("at", "key", "margin_ns", "spacing_ns", "states")

    def __init__(self, *, margin_ns: int = 0, spacing_ns: int = 1) -> None:
        self.key: tuple[object, ...] = ()
        self.at: list[int] = []
        self.states: list[State] = []
        self.margin_ns = margin_ns
        self.spacing_ns = spacing_ns

    def forget_from(self, news_ns: int) -> None:
        """Drop the checkpoints that news at ``news_ns`` may change."""
        keep = bisect.bisect_left(self.at, news_ns - self.margin_ns)
        del self.at[keep:], self.states[keep:]

    def reaches(self, news_ns: int) -> bool:
        """Whether news at ``news_ns`` would drop any of them (``forget_from``)."""
        return bool(self.at) and self.at[-1] >= news_ns - self.margin_ns

    def resume(self, key: tuple[object, ...], upto_ns: int | None = None) -> tuple[int, State] | None:
        """The last checkpoint (at or before ``upto_ns``) of a read with this key; None: start over."""
        if key != self.key:
            self.key = key
            self.at, self.states = [], []
        found = len(self.at) if upto_ns is None else bisect.bisect_right(self.at, upto_ns)
        return (self.at[found - 1], self.states[found - 1]) if found else None

    def mark(self, at_ns: int, state: State) -> None:
        if self.at and at_ns - self.at[-1] < self.spacing_ns:
            return
        self.at.append(at_ns)
        self.states.append(state)
        if len(self.at) > MAX_CHECKPOINTS:
            del self.at[0:MAX_CHECKPOINTS // 2:2], self.states[0:MAX_CHECKPOINTS // 2:2]
