"""``python -m auditor.store.migrate``: migrate the database named by ``AUDITOR_MIGRATE_DB`` to the
head revision, then exit. The daemon runs it as a child so that it never imports Alembic itself."""

from __future__ import annotations

import os
import sys

from auditor.errors import StoreError
from auditor.store.db import Store


def main() -> int:
    url = os.environ.get("AUDITOR_MIGRATE_DB")
    if not url:
        print("AUDITOR_MIGRATE_DB names no database to migrate", file=sys.stderr)
        return 2
    try:
        Store(url, check=False).upgrade()
    except StoreError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
