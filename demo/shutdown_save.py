"""The save at shutdown: the most recently used prefixes that fit the time left, then exit.

On SIGTERM (``docker stop``, Kubernetes) the server has ``--cache-save-timeout`` seconds
(default 25, inside Kubernetes' default 30 s grace period) before it must be gone; the
listener is closed first, so no request is taken meanwhile. Then ``save_before``:

- a periodic or admin save still running is cancelled (demo.cache_files: it stops at its
  next chunk and removes its temporary file);
- the bytes that fit are estimated from the throughput of the last large unpaced save of
  this process (an admin save: periodic saves are paced), file bytes over its whole time,
  fsync included, times ``SAFETY``; with none
  measured yet, a first save sized for ``PROBE_RATE`` over a quarter of the time left measures
  it; while prefixes were left out and time remains, the next save is sized by the best
  throughput measured so far (a small save's fixed costs make its figure low: on the test
  machine 12.6 MiB in 0.051 s, then 180 MiB in 0.095 s), up to ``MAX_SAVES`` saves, each
  replacing the last;
- each save has the deadline minus ``EXIT_MARGIN``: a disk slower than measured stops it at a
  chunk boundary and the file keeps what the last finished save wrote (the rename is atomic),
  or its previous content;
- a watchdog ends the process just before the deadline if the file system hangs (an fsync
  cannot be interrupted); the next start removes the temporary file left behind.

One log line says how much was saved and how much was skipped.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from radixkv import SaveAborted

log = logging.getLogger(__name__)

EXIT_MARGIN = 1.0  # seconds left for the process to exit after the save
SAFETY = 0.8  # of the bytes the measured throughput allows: disk speed varies
PROBE_RATE = 100e6  # bytes/s assumed before any save was measured (a network volume's order)
PROBE_SHARE = 0.25  # of the time left, for that first save
MAX_SAVES = 4  # a save measures the disk for the next one; each rewrites the most recent prefixes


def save_before(files, deadline: float) -> dict | None:
    """Save ``files.cache_file`` (a demo.cache_files.CacheFiles) so that it is done by
    ``deadline`` (``time.monotonic()``); returns the last save's result, or None when nothing
    was saved (the previous file stays). Never raises for a failed save: it is logged."""
    stop_by = deadline - EXIT_MARGIN
    watchdog = threading.Timer(max(0.0, deadline - 0.2 - time.monotonic()), _give_up, (files.cache_file,))
    watchdog.daemon = True
    watchdog.start()
    started, result, rate = time.monotonic(), None, files.rate
    probing = rate is None  # a rate from a large save of this process is trusted: one save
    try:
        for _ in range(MAX_SAVES):
            left = stop_by - time.monotonic()
            budget = rate * left * SAFETY if rate is not None else PROBE_RATE * left * PROBE_SHARE
            if left <= 0 or (result is not None and budget < 1.5 * result["file_bytes"]):
                break  # out of time, or the next save would add little to the last one
            try:
                result = files.save(files.cache_file, max_bytes=int(budget), deadline=stop_by, final=True)
            except SaveAborted as e:
                log.warning(
                    "shutdown save to %s %s; the file keeps its previous content", files.cache_file, e
                )
                break
            log.info(
                "shutdown save step: planned %.1f MiB, wrote %.1f MiB in %.3fs",
                budget / 2**20,
                result["file_bytes"] / 2**20,
                result["seconds"],
            )
            if not result["skipped_blocks"] or not probing:
                break
            # Each save measures the disk again: a small one's fixed costs make its figure low,
            # so the estimate only grows, and the next save is larger.
            rate = max(rate or 0.0, result["file_bytes"] / max(result["seconds"], 1e-3))
    except Exception:
        log.exception("shutdown save to %s failed; the file keeps its previous content", files.cache_file)
        return None
    finally:
        watchdog.cancel()
    if result is None:
        log.warning(
            "shutdown save: nothing saved to %s (%.1fs before the deadline)",
            files.cache_file,
            deadline - time.monotonic(),
        )
        return None
    log.info(
        "shutdown save to %s: saved %d tokens (%d nodes, %.1f MiB) in %.2fs, skipped %d less recently "
        "used tokens (%d nodes); exiting %.1fs before the deadline",
        files.cache_file,
        result["num_tokens"],
        result["num_nodes"],
        result["file_bytes"] / 2**20,
        time.monotonic() - started,
        result["skipped_tokens"],
        result["skipped_nodes"],
        deadline - time.monotonic(),
    )
    return result


def _give_up(path: str) -> None:
    log.error(
        "shutdown save to %s still running at the deadline: exiting; the file keeps its previous content",
        path,
    )
    logging.shutdown()
    os._exit(1)
