"""At shutdown, hand the commits still queued for the sidecar over before the process exits.

The demo leaves with ``os._exit`` (demo.__main__: the interpreter's teardown takes 1-2 s with
torch loaded), so the sidecar client's ``atexit`` flush never runs: without this, the prefixes
of the last requests (queued for the background writer, radixkv.sidecar.client) would die with
the process, and the replica that takes over would compute them again.

Bounded by ``FLUSH_S`` and by a share of the time left to the shutdown deadline (the cache file's
save comes after it): a dead sidecar fails every write at once (connection refused), a hung one
costs at most that bound. One log line says what was handed over, or what was dropped.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

FLUSH_S = 3.0  # at most, whatever the deadline
SHARE = 0.25  # of the time left before the deadline, for a slow (hung) sidecar


def flush_sidecar(store, deadline: float) -> tuple[int, int] | None:
    """Write ``store``'s queued sidecar commits (a radixkv KVStore or None) before ``deadline``
    (``time.monotonic()``); returns (commits written, commits lost), or None without a sidecar.
    Never raises: a failure is logged and the shutdown goes on."""
    tier = getattr(store, "remote", None)
    if tier is None:
        return None
    started = time.monotonic()
    timeout = max(0.0, min(FLUSH_S, (deadline - started) * SHARE))
    try:
        written, lost = tier.drain(timeout)
    except Exception:
        log.exception("shutdown: handing queued commits to the sidecar on %s failed", tier.path)
        return None
    seconds = time.monotonic() - started
    if lost:
        log.warning(
            "shutdown: %d commits queued for the sidecar on %s were dropped or not confirmed (sent, "
            "reply not read) (%d written in %.2fs, bound %.1fs): other replicas may compute those "
            "prefixes again",
            lost,
            tier.path,
            written,
            seconds,
            timeout,
        )
    else:
        log.info(
            "shutdown: %d queued commits written to the sidecar on %s in %.2fs", written, tier.path, seconds
        )
    return written, lost
