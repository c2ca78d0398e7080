"""Alembic environment: runs the auditor's migrations on the connection the store hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from auditor.store.tables import metadata

config = context.config
target_metadata = metadata


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = engine_from_config(config.get_section(config.config_ini_section) or {},
                                    prefix="sqlalchemy.", poolclass=pool.NullPool)
        with engine.connect() as connection:
            _run(connection)
    else:
        _run(connection)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
