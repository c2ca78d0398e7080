"""``auditor db``: schema management of the store."""

from __future__ import annotations

import click

from auditor.cli.util import common_options, errors_as_click, refuse_in_memory, store_url
from auditor.config import Config


@click.group()
def db() -> None:
    """Manage the store's schema."""


@db.command()
@common_options
def upgrade(config: Config) -> None:
    """Apply pending migrations (the daemon also does this at start)."""
    from auditor.store import Store

    if config.db:
        refuse_in_memory(config.db)
    with errors_as_click():
        store = Store(config.db or None, upgrade=True)
        click.echo(f"{store.url}: schema at {store.current_revision()} (head)")


@db.command()
@common_options
def status(config: Config) -> None:
    """Show the store's schema revision without changing anything."""
    from auditor.store import Store

    url, _found = store_url(config)
    with errors_as_click():
        store = Store(url, check=False, create=False)
        current = store.current_revision() or "none"
        head = store.head_revision()
        state = "up to date" if current == head else "needs `auditor db upgrade`"
        click.echo(f"{store.url}: schema {current}, head {head}: {state}")
