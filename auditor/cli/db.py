"""``auditor db``: schema management of the store."""

from __future__ import annotations

import click

from auditor.cli.util import (
    check_reachable,
    errors_as_click,
    reading_options,
    refuse_missing,
    store_url,
)
from auditor.config import Config


@click.group()
def db() -> None:
    """Manage the store's schema."""


@db.command()
@reading_options
def upgrade(config: Config) -> None:
    """Apply pending migrations (the daemon also does this at start)."""
    from auditor.store import Store

    url, _found = store_url(config)  # on the host, the service's database: the one to upgrade
    with errors_as_click():
        store = Store(url, upgrade=True)
        click.echo(f"{store.url}: schema at {store.current_revision()} (head)")


@db.command()
@reading_options
def status(config: Config) -> None:
    """Show the store's schema revision without changing anything."""
    from auditor.store import Store
    from auditor.store.db import revisions

    url, found = store_url(config)
    refuse_missing(url, found)
    check_reachable(config.db)
    with errors_as_click():
        store = Store(url, check=False, create=False)
        current = store.current_revision() or "none"
        known, head = revisions()
        missing = store.missing_tables() if current == head else []
        if missing:
            state = (f"table(s) {', '.join(missing)} missing: something else changed it; move it aside "
                     "(the daemon starts a new one) or restore it from a backup")
        elif current == head:
            state = "up to date"
        elif current != "none" and current not in known:
            state = "newer than this auditor knows: upgrade the auditor (its package) to read it"
        else:
            state = "needs `auditor db upgrade`"
        click.echo(f"{store.url}: schema {current}, head {head}: {state}")
        if missing:
            raise SystemExit(1)
