"""Command-line parameter types shared by the auditor's commands and the reference engine's (the
engine may not import the CLI layer)."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` without nan and inf, which pass its bounds (every comparison with nan
    is false) and then crash or stall what the option times."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give one in the range {self._describe_range()}", param, ctx)
        return number
