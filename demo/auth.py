"""Tenants and the admin token.

With API keys configured, every /v1 request needs `Authorization: Bearer <key>` and gets the
cache namespace HMAC-SHA256(server secret, key): derived on the server from the key alone,
so no client field can pick another tenant's namespace, and one tenant can neither hit
another's prefixes nor read them back through `cached_tokens` or time to first token.
Without keys everyone shares one namespace (None).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Hashable, Iterable, Mapping

from demo.schema import ApiError


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
