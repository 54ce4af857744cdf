"""Tenants and the admin token.

With API keys configured, every /v1 request needs `Authorization: Bearer <key>` and gets the
cache namespace HMAC-SHA256(server secret, key): derived on the server from the key alone,
so no client field can pick another tenant's namespace, and one tenant can neither hit
another's prefixes nor read them back through `cached_tokens` or time to first token.
Without keys everyone shares one namespace (None).

The secret is drawn at each start unless it persists in a file (``tenant_secret``): a
restored cache file's tenant prefixes then stay reachable by the same keys, and only by them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Hashable, Iterable, Mapping

from demo.errors import ApiError

log = logging.getLogger(__name__)
SECRET_BYTES = 32
EMPTY_WAIT_S = 2.0  # an empty secret file: another server is writing it (load_or_create_secret)


class TenantSecretError(ValueError):
    """The tenant secret file holds no valid secret; the message names the file."""


def _wire_bytes(value: str) -> bytes:
    """A header value as the bytes the client sent: WSGI servers decode headers as Latin-1
    (PEP 3333), so a UTF-8 key arrives as mojibake; encoding back to Latin-1 restores its
    bytes. A str that cannot be Latin-1 never came off the wire (in-process test clients):
    its UTF-8 encoding is what a client would have sent."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def _bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class Auth:
    def __init__(self, api_keys: Iterable[str], admin_token: str | None, secret: bytes):
        self._secret = secret
        # digest -> namespace; looking up a digest compares no key bytes directly.
        self._tenants = {self._digest(k): "tenant:" + self._digest(k)[:32] for k in api_keys}
        self._admin = admin_token

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def _digest(self, key: str | bytes) -> str:
        # Configured keys are text (UTF-8); a key from a header comes as its wire bytes.
        raw = key if isinstance(key, bytes) else key.encode("utf-8")
        return hmac.new(self._secret, raw, hashlib.sha256).hexdigest()

    def namespace(self, headers: Mapping[str, str]) -> Hashable:
        """The caller's cache namespace; ApiError 401 if keys are required and missing/unknown."""
        if not self._tenants:
            return None
        key = _bearer(headers)
        ns = self._tenants.get(self._digest(_wire_bytes(key))) if key else None
        if ns is None:
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not key else "incorrect API key"
            raise ApiError(401, msg, code="invalid_api_key")
        return ns

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """ApiError 403 if no admin token is configured, 401 if the request lacks it."""
        if not self._admin:
            raise ApiError(
                403,
                "this server has no admin token (start it with --admin-token or "
                "RADIXKV_ADMIN_TOKEN), so admin endpoints are disabled",
                code="admin_disabled",
            )
        given = headers.get("X-Admin-Token") or _bearer(headers) or ""
        if not hmac.compare_digest(_wire_bytes(given), self._admin.encode("utf-8")):
            raise ApiError(401, "missing or incorrect admin token", code="invalid_admin_token")


def secret_file(config) -> str | None:
    """Where ``config``'s tenant secret persists: its own setting, else beside the cache file."""
    if config.tenant_secret_file:
        return config.tenant_secret_file
    return config.cache_file + ".secret" if config.cache_file else None


def tenant_secret(config) -> bytes:
    """The HMAC secret: with API keys, from ``secret_file(config)`` (created if missing); else
    ``config.tenant_secret`` (random per start unless set)."""
    path = secret_file(config) if config.api_keys else None  # no tenants: nothing to keep
    return load_or_create_secret(path) if path else config.tenant_secret


def load_or_create_secret(path: str) -> bytes:
    """The secret in ``path`` (hex), or a new random one written there with mode 0600.

    Created with O_EXCL, so two servers starting at once agree on one secret; the file is
    empty between the winner's create and its write, so an empty file is read again for up to
    ``EMPTY_WAIT_S`` (replicas started together on one ``--tenant-secret-file``). A file that
    others may read is tightened to 0600 with a warning (the secret maps keys to tenants).
    Raises TenantSecretError (a ValueError) for a file that holds no valid secret: a new one
    would orphan every tenant's saved prefixes silently.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("tenant secret %s had mode %o; restricting it to the owner (0600)", path, mode)
            os.chmod(path, 0o600)
        deadline = time.monotonic() + EMPTY_WAIT_S
        while True:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read().strip()
            if text or time.monotonic() >= deadline:
                break
            time.sleep(0.02)  # another server created it and is writing it now
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) < 16:
            raise TenantSecretError(
                f"tenant secret file {path} does not hold a hex secret of at least 16 bytes"
            ) from None
        return secret
    secret = os.urandom(SECRET_BYTES)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secret.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    log.info("created tenant secret %s (mode 0600)", path)
    return secret
