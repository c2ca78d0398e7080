"""``python -m auditor``: the same as the ``auditor`` command."""

from auditor.cli import main

main()
