"""Trusted proxies (``--trusted-proxies``): which peers may say who the client is.

    proxies = TrustedProxies.parse(["127.0.0.1", "10.0.0.0/8"])
    proxies.client("10.0.0.4", "203.0.113.7, 10.0.0.9")   # "203.0.113.7"
    proxies.client("10.0.0.4", None)                      # None: the proxy's own request
    proxies.client("198.51.100.2", "1.2.3.4")             # "198.51.100.2": not trusted, XFF ignored

Behind a gateway every request comes from the gateway's address. The failed-authentication
throttle (demo.api.auth_throttle) keys on the client, so without this one client guessing keys
would lock every tenant out. A request from a trusted peer is keyed on the right-most address
of its ``X-Forwarded-For`` that is not itself a trusted proxy (the left part of the header is
whatever the client wrote); one without the header (the gateway's own, or a gateway that does
not forward the client, as sglang_router 0.3 does not) names no client, and is never throttled
as one. Connections from trusted peers are not counted against the per-address connection cap
either (demo.api.server): a gateway keeps many connections for all of its clients.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrustedProxies:
    networks: tuple = ()  # ipaddress networks

    @classmethod
    def parse(cls, entries: Iterable[str]) -> TrustedProxies:
        """Addresses or networks (``10.0.0.0/8``, ``::1``); ValueError naming a bad entry."""
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ValueError(
                    f"--trusted-proxies: {entry!r} is not an IP address or network (e.g. 10.0.0.0/8)"
                ) from None
        return cls(tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, address: str | None) -> bool:
        if not self.networks or not address:
            return False
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    def client(self, peer: str | None, forwarded_for: str | None) -> str | None:
        """The client's address: ``peer`` unless it is trusted; then the right-most untrusted
        address in ``forwarded_for``, or None when it names none."""
        if not self.trusts(peer):
            return peer
        hops = [h.strip() for h in (forwarded_for or "").split(",") if h.strip()]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop
        return None
