"""A small SQLite handle shared by the stores that several processes open at once
(the simulated world, the account guard): WAL, one connection per thread, and
write transactions taken up front so concurrent writers queue instead of failing."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class SqliteDb:
    def __init__(self, path: str | Path, schema: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._conn().executescript(schema)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if conn.in_transaction:  # executescript() commits by itself
            conn.execute("COMMIT")

    def data_version(self) -> int:
        """Changes whenever another connection (any process or thread) commits."""
        return self._conn().execute("PRAGMA data_version").fetchone()[0]

    def query(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return self._conn().execute(sql, args).fetchall()
