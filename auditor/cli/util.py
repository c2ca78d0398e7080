"""Pieces every command shares: the ``--db``/``--config`` bundle, parameter types, error handling.

Commands stay thin: they parse with these, call the library, and print. Library errors
(``AuditorError``) become ``click.ClickException`` here, at the edge, and nowhere else.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from auditor.config import Config, apply_overrides, load_config
from auditor.errors import AuditorError, ConfigError

F = TypeVar("F", bound=Callable[..., Any])


DB_HELP = "Database URL [default: auditor.db in systemd's $STATE_DIRECTORY, else in this directory]."
FOUND_DB_HELP = ("Database URL [default: the auditor service's /var/lib/auditor/auditor.db when it exists, "
                 "else auditor.db in this directory].")


def common_options(func: F) -> F:
    """Add ``--db`` and ``--config`` and pass the resolved ``config`` to the command."""
    return _with_common_options(func, DB_HELP)


def apply_flags(config: Config, overrides: Mapping[str, Any], flags: Mapping[str, str]) -> Config:
    """Apply a command's flags (``overrides``: configuration key -> value, None for not given) one at a
    time. The configuration came in valid (``load_config`` checks the file and the environment), so
    a value refused now is the flag's: a usage error naming the flag (``flags``: key -> flag; exit
    2), where the same value from the config file names its key (exit 1)."""
    for key, value in overrides.items():
        try:
            config = apply_overrides(config, {key: value})
        except ConfigError as exc:
            flag = flags.get(key, key)
            message = str(exc).removeprefix(f"{key} = ").removeprefix(f"{key} ").replace(key, flag)
            raise click.BadParameter(message, param_hint=f"'{flag}'") from exc
    return config


def reading_options(func: F) -> F:
    """``common_options`` for a command that reads what the daemon wrote: without a database named,
    it opens the service's (``store_url``), and its help says so."""
    return _with_common_options(func, FOUND_DB_HELP)


def _with_common_options(func: F, db_help: str) -> F:
    @click.option("--config", "config_path", type=click.Path(dir_okay=False),
                  help="TOML configuration file (AUDITOR_* variables override it).")
    @click.option("--db", "db_url", metavar="URL", help=db_help)
    @functools.wraps(func)
    def wrapper(*args: Any, config_path: str | None, db_url: str | None, **kwargs: Any) -> Any:
        with errors_as_click():
            config = load_config(config_path, overrides={"db": db_url})
        origin = _db_origin(db_url, config_path)
        click.get_current_context().meta[DB_ORIGIN] = origin
        if config.db:
            _check_db_url(config.db, origin)
        return func(*args, config=config, **kwargs)

    return wrapper  # type: ignore[return-value]


DB_ORIGIN = "auditor.db_origin"


def _db_origin(db_url: str | None, config_path: str | None) -> str:
    """Where the database URL came from, as errors name it (``URL`` stands for it): the later
    source wins, as in ``load_config``."""
    if db_url is not None:
        return "--db URL"
    if "AUDITOR_DB" in os.environ:
        return "AUDITOR_DB URL"
    return f"db URL in {config_path or os.environ.get('AUDITOR_CONFIG') or 'the config file'}"


def named_db(url: str, origin: str | None = None) -> str:
    """The database URL as errors name it, with where it came from: ``--db 'x'``, ``AUDITOR_DB 'x'``
    or ``db 'x' in auditor.toml``."""
    if origin is None:
        ctx = click.get_current_context(silent=True)
        origin = (ctx.meta.get(DB_ORIGIN) if ctx is not None else None) or "--db URL"
    return origin.replace("URL", repr(url), 1)


def db_source() -> str:
    """Where the database URL came from, as advice names it: ``--db``, ``AUDITOR_DB`` or ``db in auditor.toml``."""
    ctx = click.get_current_context(silent=True)
    origin = (ctx.meta.get(DB_ORIGIN) if ctx is not None else None) or "--db URL"
    return origin.replace(" URL", "", 1)


def check_reachable(url: str) -> None:
    """Fail early, naming the server and where its URL came from, when a network database does not
    answer; ``report`` and ``db status`` say it alike.

    SQLite files are checked by the store itself; a server that is down would otherwise surface
    as a schema error that suggests moving the database aside.
    """
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    if not url:
        return
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return  # the store explains malformed URLs
    if parsed.get_backend_name() == "sqlite":
        return
    where = parsed.render_as_string(hide_password=True)
    try:
        engine = create_engine(parsed, connect_args=_connect_timeout(parsed.get_backend_name()))
    except (ImportError, ArgumentError):
        return  # the store explains missing drivers
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise click.ClickException(
            f"cannot reach the database at {where} ({reason[0] if reason else type(exc).__name__}); "
            f"check that the server is running, the host and port given by {db_source()}, and the user "
            "and password") from exc
    finally:
        engine.dispose()


def _connect_timeout(backend: str) -> dict[str, int]:
    return {"connect_timeout": 5} if backend == "postgresql" else {}


def _check_db_url(url: str, origin: str) -> None:
    """Refuse a URL SQLAlchemy cannot parse, naming where it came from. A plain SQLite file's URL
    needs no parsing (and the daemon, no SQLAlchemy)."""
    from auditor.store.db import sqlite_file

    if sqlite_file(url) is not None:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number, a broken [IPv6]
        raise click.ClickException(f"{named_db(url, origin)} is not a database URL; try sqlite:///auditor.db "
                                   "or postgresql+psycopg://user@host/db") from None


def in_memory(url: str) -> bool:
    """Whether ``url`` is SQLite in memory (``sqlite://``, ``sqlite:///:memory:``, a ``mode=memory``
    URI): a database that lives and dies with one process."""
    from auditor.store.db import sqlite_file

    if not url.startswith("sqlite") or sqlite_file(url) is not None:
        return False
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return False
    database = parsed.database or ""
    return parsed.get_backend_name() == "sqlite" and (
        database in ("", ":memory:") or database.startswith("file::memory:")
        or parsed.query.get("mode") == "memory" or "mode=memory" in database)


def refuse_in_memory(url: str) -> None:
    """For commands that read or upgrade a stored database: one in memory holds nothing they could."""
    if in_memory(url):
        raise click.ClickException(f"{named_db(url)} is SQLite in memory, which holds nothing across "
                                   "processes; give a file, e.g. sqlite:///auditor.db")


class errors_as_click:
    """Context manager: library errors become one-line ``Error: ...`` messages with exit code 1."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, AuditorError):
            raise click.ClickException(str(exc)) from exc


def store_url(config: Config) -> tuple[str, bool]:
    """The database a reading command opens, and whether it was found rather than named.

    Named: ``--db``, the config file's ``db`` or ``AUDITOR_DB``. Found: the systemd unit's database
    when it exists (so ``auditor report`` on the host needs no ``--db``), else ``auditor.db`` here.
    """
    from auditor.store import default_db_url

    if config.db:
        refuse_in_memory(config.db)
        return config.db, False
    with errors_as_click():
        return default_db_url(find_service_db=True), True


def refuse_missing(url: str, found: bool) -> None:
    """For commands that only read: a SQLite file that is not there is refused, naming the setting
    to change (``--db``, ``AUDITOR_DB``, ``db in auditor.toml``), before anything creates it."""
    from auditor.store.db import sqlite_file

    database = sqlite_file(url)
    if not database or database == ":memory:" or database.startswith("file:") or Path(database).exists():
        return
    source = "--db" if found else db_source()
    if source == "--db":
        raise click.ClickException(f"no database at {database}; run `auditor run` first or pass --db")
    raise click.ClickException(f"no database at {database} (from {source}); run `auditor run` first or set "
                               f"{source} to the database it writes")


def open_store(config: Config, *, create: bool = True) -> Any:
    """The configured store, migrated; errors become click errors.

    A database the command found by itself is named on standard error, so nobody reads the
    wrong file's findings without knowing it.
    """
    from auditor.store import Store

    url, found = store_url(config)
    if not create:
        refuse_missing(url, found)
    with errors_as_click():
        store = Store(url, create=create)
    if found:
        click.echo(f"database: {store.where()}", err=True)
    return store


class PortType(click.ParamType):  # type: ignore[type-arg]  # generic only in newer click
    """A TCP port number, 1-65535."""

    name = "port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not (text.isascii() and text.isdigit()):  # int() refuses "²"
                self.fail(f"{value!r} is not a port number; use 1-65535, e.g. --port 8000", param, ctx)
            number = int(text)
        if not 1 <= number <= 65535:
            self.fail(f"{number} is out of range; use 1-65535, e.g. --port 8000", param, ctx)
        return number


# One or more <number><unit> parts, largest unit first: 30m, 1h30m, 1h 30m, 2d12h, 1.5h, 500ms.
# ASCII digits only, as for ports: \d would take an Arabic-Indic one (U+0661 then h) for 1h.
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)")
_DURATION = re.compile(r"^\s*(?:[0-9]+(?:\.[0-9]+)?\s*(?:ms|s|m|h|d|w)\s*)+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> dt.timedelta | None:
    """A duration such as ``90s``, ``1h30m`` or ``2d 12h``; None when ``text`` is not written as one.

    Raises ValueError when it is written as one but its units repeat or go up (``30m1h``, ``1h1h``):
    that is almost always a typo, and guessing would silently pick the wrong window.
    """
    if not _DURATION.match(text):
        return None
    seconds = 0.0
    previous: str | None = None
    for number, unit in _DURATION_PART.findall(text):
        if previous is not None and _UNIT_SECONDS[unit] >= _UNIT_SECONDS[previous]:
            raise ValueError(f"{text.strip()!r}: {unit!r} after {previous!r}; "
                             "write each unit once, largest first, e.g. 1h30m")
        seconds += float(number) * _UNIT_SECONDS[unit]
        previous = unit
    return dt.timedelta(seconds=seconds)


EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
# Times are stored as signed 64-bit nanoseconds since 1970: the last one is in April 2262.
LATEST = EPOCH + dt.timedelta(microseconds=(2**63 - 1) // 1000)


def now() -> dt.datetime:
    """This invocation's "now", read once: ``--since 1h --until 1h`` is an empty window, not a
    window of the microseconds between reading the clock for each option."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return dt.datetime.now(dt.timezone.utc)
    moment: dt.datetime = ctx.meta.setdefault("auditor.now", dt.datetime.now(dt.timezone.utc))
    return moment


class TimeType(click.ParamType):  # type: ignore[type-arg]
    """A moment: a duration back from now (``30m``, ``1h30m``, ``2d``) or an RFC 3339 time, from
    1970 to 2262 (what 64-bit nanoseconds since 1970 hold)."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dt.datetime:
        if isinstance(value, dt.datetime):
            return value
        text = str(value)
        try:
            duration = parse_duration(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        except OverflowError:
            duration = dt.timedelta.max  # more days than a timedelta holds: long before 1970
        if duration is not None:
            current = now()
            if duration > current - EPOCH:
                self.fail(f"{text.strip()!r} back from now reaches before 1970; give a shorter duration "
                          "or a time, e.g. 2d or 2026-11-22T10:00:00Z", param, ctx)
            return current - duration
        try:
            moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))  # RFC 3339: z too
        except ValueError:
            self.fail(f"{text!r} is neither a duration nor a time; "
                      "use e.g. 30m, 1h30m, 2d or 2026-11-22T10:00:00Z", param, ctx)
        if moment.tzinfo is None:
            self.fail(f"{text!r} has no time zone; add one, e.g. 2026-11-22T10:00:00Z", param, ctx)
        try:
            too_early, too_late = moment < EPOCH, moment > LATEST
        except OverflowError:  # a zone offset that moves the time out of datetime's years 1-9999
            too_early, too_late = moment.year < 1970, moment.year >= 1970
        if too_early:
            self.fail(f"{text!r} is before 1970, earlier than anything recorded; "
                      "give a later time, e.g. 2026-11-22T10:00:00Z", param, ctx)
        if too_late:
            self.fail(f"{text!r} is too far in the future (the latest time is "
                      f"{LATEST.isoformat(timespec='seconds')}); give an earlier time", param, ctx)
        return moment


def future_since(since: dt.datetime) -> str:
    """Why a window that starts after now and has no --until is empty (it would end now)."""
    return (f"{since.isoformat(timespec='seconds')} is in the future, and the window ends now; "
            "give an earlier time or a duration back from now, e.g. --since 1h")


def window_end(since: dt.datetime, until: dt.datetime | None, now: dt.datetime) -> dt.datetime:
    """The window's end (``until``, else now), refusing an empty window with the option to blame:
    --since when the window was to end now, --until when both were given."""
    if until is None:
        if since > now:
            raise click.BadParameter(future_since(since), param_hint="--since")
        if since == now:
            raise click.BadParameter(f"{since.isoformat(timespec='seconds')} is now: the window up to now is "
                                     "empty; give a duration back from now, e.g. --since 1h", param_hint="--since")
        return now
    if until <= since:
        raise click.BadParameter(f"{until.isoformat(timespec='seconds')} is not after --since "
                                 f"{since.isoformat(timespec='seconds')}; e.g. --since 2h --until 1h",
                                 param_hint="--until")
    return until


PORT = PortType()
TIME = TimeType()
