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

    def _digest(self, key: str) -> str:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def namespace(self, headers: Mapping[str, str]) -> Hashable:
        """The caller's cache namespace; ApiError 401 if keys are required and missing/unknown."""
        if not self._tenants:
            return None
        key = _bearer(headers)
        ns = self._tenants.get(self._digest(key)) if key else None
        if ns is None:
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not key else "incorrect API key"
            raise ApiError(401, msg, code="invalid_api_key")
        return ns

    def namespaces(self) -> list[Hashable]:
        """Every tenant's cache namespace ([None] without keys): where operator prompts are pinned."""
        return list(self._tenants.values()) if self._tenants else [None]

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
        if not hmac.compare_digest(given.encode(), self._admin.encode()):
            raise ApiError(401, "missing or incorrect admin token", code="invalid_admin_token")
