"""A bench's runs in git revision REV's tree beside the working tree's, each in its own process.

The benches that take ``--compare REV`` run themselves again with ``--tree``: that child imports
the given tree's ``auditor`` before anything puts the working tree on the path (``use_tree``).
``compared`` exports REV's tree (``bench/ingest.export_tree``: its C extensions built) and lists
the trees in the order they run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def use_tree(tree: Path | None) -> None:
    """Import ``tree``'s packages (None: the working tree's), then make the bench helpers importable."""
    if tree:
        sys.path.insert(0, str(tree))
        import auditor  # noqa: F401  # this tree's, before the bench helpers put the working tree first
    sys.path.insert(1, str(HERE.parent))
    sys.path.insert(1, str(HERE))


def compared(rev: str | None, prefix: str) -> tuple[dict[str, Path], tempfile.TemporaryDirectory[str] | None]:
    """The trees to run, by label: REV's exported into a temporary folder (returned, to clean up)
    and the working tree; the working tree alone without REV."""
    if not rev:
        return {"working tree": HERE.parent}, None
    from ingest import export_tree

    work = tempfile.TemporaryDirectory(prefix=prefix)
    return {rev: export_tree(rev, Path(work.name)), "working tree": HERE.parent}, work
