"""The zombie-request auditor: finds LLM inference that kept running after its client left."""

from __future__ import annotations

__version__ = "0.1.0"
