"""Parse an L2 URL into a frozen config; every error is a ValueError naming the part that is wrong.

Accepted forms (docs/l2.md):

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``   Redis or Valkey over TCP (port 6379, db 0)
- ``rediss://...``                                 the same over TLS
- ``unix://[[USER]:PASSWORD@]/PATH[?db=N]``        Redis on a Unix domain socket
- ``file:DIR`` or ``file:///DIR``                  a directory, e.g. on a shared filesystem

User name and password may also come as options (``username=``, ``password=``); percent-escapes
in the URL are decoded (a password with ``@`` or ``:`` is written ``%40``, ``%3A``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis", "rediss", "unix", "file")


@dataclass(frozen=True)
class L2Url:
    """One parsed L2 URL. ``scheme`` is one of SCHEMES; for ``file`` only ``path`` is set."""

    scheme: str
    host: str | None = None
    port: int | None = None
    db: int = 0
    path: str | None = None  # the Unix socket (unix) or the directory (file)
    username: str | None = None
    password: str | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"L2 URL scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")

    def redacted(self) -> str:
        """The URL for log lines: never the password."""
        auth = (
            f"{self.username or ''}:***@" if self.password else (f"{self.username}@" if self.username else "")
        )
        if self.scheme == "file":
            return f"file:{self.path}"
        if self.scheme == "unix":
            return f"unix://{auth}{self.path}?db={self.db}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"


def _db_number(text: str, url: str) -> int:
    if not text.isdigit():
        raise ValueError(f"L2 URL {url!r}: database must be a number >= 0, got {text!r}")
    return int(text)


def parse_url(url: str) -> L2Url:
    """The L2Url of ``url``; ValueError naming the scheme, host, port, database, path or query."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"L2 URL must be a non-empty string, got {url!r}")
    scheme, sep, rest = url.partition(":")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"L2 URL {url!r}: scheme must be one of {', '.join(s + ':' for s in SCHEMES)}")
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest
        if not path:
            raise ValueError(f"L2 URL {url!r}: file: needs a directory, e.g. file:/mnt/shared/radixkv")
        return L2Url("file", path=unquote(path))
    parts = urlsplit(url)
    if parts.fragment:
        raise ValueError(f"L2 URL {url!r}: a fragment (#...) means nothing here")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    query = parse_qs(parts.query, keep_blank_values=True)
    if scheme == "unix":
        unknown = set(query) - {"db"}
        if unknown:
            raise ValueError(f"L2 URL {url!r}: unknown query parameter(s) {sorted(unknown)} (allowed: db)")
        if not parts.path:
            raise ValueError(f"L2 URL {url!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock")
        db = _db_number(query["db"][-1], url) if "db" in query else 0
        return L2Url("unix", path=unquote(parts.path), db=db, username=username, password=password)
    if query:
        raise ValueError(
            f"L2 URL {url!r}: query parameters are not read for {scheme}:// (pass options instead)"
        )
    try:
        port = parts.port
    except ValueError:
        netloc_port = parts.netloc.rpartition(":")[2]
        raise ValueError(f"L2 URL {url!r}: port must be a number 1-65535, got {netloc_port!r}") from None
    if port == 0:
        raise ValueError(f"L2 URL {url!r}: port must be a number 1-65535, got 0")
    host = parts.hostname
    if not host:
        raise ValueError(f"L2 URL {url!r}: host is missing, e.g. {scheme}://127.0.0.1:6379/0")
    db_text = parts.path.lstrip("/")
    db = _db_number(db_text, url) if db_text else 0
    return L2Url(scheme, host=host, port=port or 6379, db=db, username=username, password=password)
