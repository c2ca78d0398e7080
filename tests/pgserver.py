"""A throwaway PostgreSQL server in a temporary directory on loopback, for the fleet tests."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def find_pg_bin() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(candidates[-1]).parent if candidates else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def postgres_server(base: Path) -> Iterator[str]:
    """Start PostgreSQL (initdb + pg_ctl) under ``base``; yield a SQLAlchemy URL; stop it after."""
    pg_bin = find_pg_bin()
    if pg_bin is None:
        raise RuntimeError("PostgreSQL server binaries not found; run `make setup` as root")
    data, sockets = base / "pgdata", base / "pgsock"
    sockets.mkdir(parents=True)
    # initdb refuses to run as root: run the server as the distribution's postgres user.
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_user, str(pg_bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "auditor"],
                   check=True, capture_output=True)
    port = _free_port()
    options = f"-k {sockets} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, str(pg_bin / "pg_ctl"), "-D", str(data), "-o", options, "-w", "-t", "30",
                    "-l", str(base / "pg.log"), "start"], check=True, capture_output=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"postgresql+psycopg://auditor@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
