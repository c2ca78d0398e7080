"""``python -m replay.engine``: the same as ``auditor engine``."""

from replay.engine.cli import engine

engine(prog_name="python -m replay.engine")
