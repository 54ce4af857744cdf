"""The KV cache on disk: restore at start, save at shutdown / periodically, admin endpoints.

    --cache-file PATH      restored at start when present; saved on SIGTERM / Ctrl-C and,
                           with --cache-save-every S, every S seconds
    --cache-save-timeout S on SIGTERM, exit within S seconds: the most recently used prefixes
                           that fit are saved (demo.shutdown_save)
    --cache-dir DIR        named files for the admin endpoints below

POST /v1/cache/save    {"name": optional}  -> the file written (default: --cache-file)
POST /v1/cache/restore {"name": optional, "evict": optional bool, default false}
                                           -> what was restored, dropped, already cached, evicted
GET  /v1/cache/files                       -> files in --cache-dir (and --cache-file): size, manifest

Restores: the start-up restore runs with ``evict=True``: the store then holds nothing a
request warmed (only pinned task prompts, which are never evicted), so the file's prefixes
may take all the room there is, the device's and then the host tier's. The admin restore
runs into a store that is serving: by default it takes free blocks only (never evicts);
``"evict": true`` lets the file's prefixes displace the least recently used unpinned ones.

Periodic saves run in a thread that only takes CPU time the requests leave (Linux
SCHED_IDLE), so requests keep their latency while one runs (docs/benchmarks.md "The cache on disk"); a
save in progress when the server shuts down is cancelled at its next chunk, its temporary
file removed.

All three need the admin token, like /v1/cache/flush. A name is a plain file name inside
--cache-dir (letters, digits, '.', '_', '-'; no separators, no '..'): anything else is a 400.

At start: a missing --cache-file is logged (it is written at shutdown) and the server starts
cold. A damaged file, or one saved for other weights of the same model configuration (a new
checkpoint at the same path), never blocks a start: it is moved aside (``PATH.rejected-<time>``),
the reason is logged, and the server starts cold. A file saved under other flags (another
--model class or configuration, --block-size or --dtype: demo.cache_mismatch) is most likely a
mistyped flag: it is left in place and the server refuses to start (CacheFileConflict) with a
message naming the flag, so a restart with the right flags restores it.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from flask import Blueprint, jsonify, request

import hf_patch
from demo.cache_mismatch import describe
from demo.errors import ApiError
from demo.request_json import json_body
from radixkv import CacheFileError, CacheFileMismatch, SaveAborted
from radixkv.persist.cache_file import read_manifest

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
RATE_MIN_BYTES = 32 << 20  # smaller saves are mostly fixed costs: no throughput measured from them
# How the periodic save thread (and the writer thread it starts, which inherits it) is
# scheduled: "idle" (Linux SCHED_IDLE: only CPU time the request threads leave), "nice" (nice
# 10) or "normal". p99 request latency during 2 GiB saves: docs/benchmarks.md "The cache on disk".
PERIODIC_SCHEDULING = "idle"
# Bytes/s of KV a periodic save writes at most: spread thin, its memory traffic (hash, copy into
# the page cache) leaves requests their latency; None: as fast as it goes.
PERIODIC_RATE: float | None = 256e6


class CacheFileConflict(ValueError):
    """--cache-file holds the cache of a model or store that other start-up flags make; left in place."""


def background_priority(how: str) -> None:
    """Lower the calling thread's CPU priority as ``how`` says; where the platform cannot
    (not Linux), it keeps its priority: the save is still correct, only less polite."""
    try:
        if how == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        elif how == "nice":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class CacheFiles:
    """Saves and restores ``engine``'s store for one server (with reuse off there is none: 409)."""

    def __init__(self, engine, config) -> None:
        self.engine = engine
        self.model_flag = config.model
        self.cache_file = config.cache_file
        self.cache_dir = config.cache_dir
        self.every = config.cache_save_every
        self.timeout = config.cache_save_timeout
        # bytes/s of the last unpaced save of >= RATE_MIN_BYTES (an admin save), fsync included:
        # sizes the shutdown save
        self.rate: float | None = None
        self._lock = threading.Lock()  # one save or restore at a time: no two writers of one file
        self._stop = threading.Event()
        self._cancel = threading.Event()  # set at shutdown: a periodic or admin save stops
        self._thread: threading.Thread | None = None

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, name: object) -> str:
        """The file a request names (None: --cache-file); ApiError 400 for anything else."""
        if name is None:
            if not self.cache_file:
                raise ApiError(400, "no name given and the server has no --cache-file", "name")
            return self.cache_file
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            raise ApiError(
                400,
                "name must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                "without path separators or '..'",
                "name",
            )
        if not self.cache_dir:
            raise ApiError(400, "named cache files need the server to be started with --cache-dir", "name")
        return os.path.join(self.cache_dir, name if name.endswith(SUFFIX) else name + SUFFIX)

    # -- operations ----------------------------------------------------------------------------
    def _store(self):
        if self.engine.store is None:
            raise ApiError(409, "prefix reuse is off on this server: there is no cache to save or restore")
        return self.engine.store

    def save(
        self,
        path: str | None = None,
        *,
        max_bytes: int | None = None,
        deadline: float | None = None,
        final: bool = False,
        max_rate: float | None = None,
    ) -> dict:
        """Save to ``path`` (default --cache-file); ``max_bytes`` / ``deadline``: see
        ``hf_patch.save_cache``. Saves but the ``final`` one stop once shutdown begins
        (radixkv.SaveAborted). Returns the SaveResult as a dict (``seconds`` rounded)."""
        store = self._store()
        path = path or self.path_for(None)
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._lock.acquire(timeout=wait):
            raise SaveAborted("another save or restore of the cache was still running at the deadline")
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            result = hf_patch.save_cache(
                self.engine.model,
                path,
                store,
                max_bytes=max_bytes,
                deadline=deadline,
                cancel=None if final else self._cancel,
                max_rate=max_rate,
            )
        finally:
            self._lock.release()
        if result.file_bytes >= RATE_MIN_BYTES and max_rate is None:  # a paced save says little
            self.rate = result.file_bytes / result.seconds
        out = dataclasses.asdict(result)
        out["seconds"] = round(result.seconds, 3)
        return out

    def restore(self, path: str, *, evict: bool = False) -> dict:
        store = self._store()
        with self._lock:
            result = hf_patch.restore_cache(self.engine.model, path, store, evict=evict)
        out = dataclasses.asdict(result)
        out["seconds"] = round(result.seconds, 3)
        return out

    def restore_at_start(self) -> dict | None:
        """Restore --cache-file if it exists. A damaged file, or one of other weights, is moved
        aside and logged; one written under other flags raises CacheFileConflict (left in place)."""
        path = self.cache_file
        if not path or self.engine.store is None:
            return None
        self._remove_stale_temporaries()
        if not os.path.exists(path):
            log.info(
                "cache file %s does not exist yet: starting cold; it will be written at shutdown%s",
                path,
                f" and every {self.every:g} s" if self.every else "",
            )
            return None
        log.info("restoring the cache from %s (%.1f MiB) ...", path, os.path.getsize(path) / (1 << 20))
        try:
            result = self.restore(path, evict=True)  # nothing a request warmed is in the store yet
        except CacheFileMismatch as e:
            why = self.mismatch(path)
            if why.flag_mistake:
                raise CacheFileConflict(
                    f"--cache-file {path} was written under other flags: {why.words}. Start with the "
                    f"flags it was written with, or move the file away (or pass another --cache-file) "
                    f"to start cold; the file is left as it is. Details: {e}"
                ) from None
            self._move_aside(path, f"{why.words}; details: {e}")
            return None
        except (CacheFileError, OSError) as e:
            self._move_aside(path, str(e))
            return None
        except Exception:  # a bug of ours must not block a restart either; the file stays for a look
            log.exception("restoring %s failed; starting cold (the file is left in place)", path)
            return None
        log.info(
            "restored %d cached tokens from %s in %.2fs (%d on the host tier, %d already cached, "
            "%d dropped for room)%s",
            result["restored_tokens"],
            path,
            result["seconds"],
            result["host_blocks"] * self.engine.store.block_size,
            result["duplicate_tokens"],
            result["dropped_tokens"],
            f" and {result['restored_snapshots']} recurrent-state snapshots ({result['dropped_snapshots']} "
            "dropped)"
            if result["num_snapshots"]
            else "",
        )
        return result

    def mismatch(self, path: str):
        """demo.cache_mismatch.Mismatch for a file radixkv refused as another model's or store's."""
        return describe(read_manifest(path), self.engine.model, self.engine.store, self.model_flag)

    def _move_aside(self, path: str, reason: str) -> None:
        aside = f"{path}.rejected-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            os.replace(path, aside)
            log.warning("cache file %s refused (%s); moved to %s, starting cold", path, reason, aside)
        except OSError as move_error:
            log.warning(
                "cache file %s refused (%s) and not moved (%s); starting cold", path, reason, move_error
            )

    def _remove_stale_temporaries(self) -> None:
        """A save killed mid-write (SIGKILL past the grace period) leaves its temporary file."""
        directory, name = os.path.split(os.path.abspath(self.cache_file))
        for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp")):
            try:
                os.unlink(stale)
                log.info("removed %s, left by a save that did not finish", stale)
            except OSError:
                pass

    def save_at_exit(self, deadline: float | None = None) -> None:
        """Final save to --cache-file (SIGTERM / Ctrl-C), done by ``deadline`` (``time.monotonic()``;
        default: --cache-save-timeout from now); errors are logged, the old file kept."""
        from demo.shutdown_save import save_before  # it imports this module

        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        self._cancel.set()  # a periodic or admin save stops at its next chunk
        self.stop(timeout=max(0.0, deadline - time.monotonic()))
        if not self.cache_file or self.engine.store is None:
            return
        save_before(self, deadline)

    # -- periodic saves ------------------------------------------------------------------------
    def start_periodic(self) -> None:
        if not self.every or not self.cache_file or self.engine.store is None:
            return
        self._thread = threading.Thread(target=self._periodic, name="radixkv-cache-save", daemon=True)
        self._thread.start()

    def _periodic(self) -> None:
        background_priority(PERIODIC_SCHEDULING)
        while not self._stop.wait(self.every):
            try:
                self.save(self.cache_file, max_rate=PERIODIC_RATE)
            except SaveAborted:
                return  # shutting down
            except Exception:  # a full disk must not kill the thread: the next period retries
                log.exception("periodic save to %s failed; the previous file is unchanged", self.cache_file)

    def stop(self, timeout: float = 60) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # -- listing -------------------------------------------------------------------------------
    def files(self) -> list[dict]:
        paths = []
        if self.cache_dir and os.path.isdir(self.cache_dir):
            paths += sorted(
                os.path.join(self.cache_dir, n) for n in os.listdir(self.cache_dir) if n.endswith(SUFFIX)
            )
        if self.cache_file and os.path.exists(self.cache_file) and self.cache_file not in paths:
            paths.append(self.cache_file)
        out = []
        for path in paths:
            entry = {"name": os.path.basename(path), "path": path, "bytes": os.path.getsize(path)}
            entry["modified"] = int(os.path.getmtime(path))
            try:
                manifest = read_manifest(path)
                entry["manifest"] = {k: v for k, v in manifest.items() if k != "checksums"}
            except (CacheFileError, OSError) as e:
                entry["error"] = str(e)
            out.append(entry)
        return out


def _body(fields: tuple[str, ...]) -> dict:
    """The request's JSON object ({} for an empty body); a 400 for anything but ``fields``."""
    data = request.get_data(cache=False)
    if not data.strip():
        return {}
    body = json_body(data)
    if body is None:
        return {}
    if not isinstance(body, dict) or set(body) - set(fields):
        named = " and ".join(f'"{f}"' for f in fields)
        raise ApiError(400, f"the body must be a JSON object with at most the fields {named}")
    return body


def blueprint(files: CacheFiles, check_admin: Callable[[], None]) -> Blueprint:
    """``check_admin()`` raises the API's 401/403/429 (the app's admin check, under its
    failed-authentication throttle, so these endpoints cannot be used to guess the token)."""
    bp = Blueprint("radixkv_cache_files", __name__)

    @bp.post("/v1/cache/save")
    def save():
        check_admin()
        path = files.path_for(_body(("name",)).get("name"))
        try:
            return jsonify({"saved": True, **files.save(path)})
        except SaveAborted as e:
            raise ApiError(
                503, f"{e}: the server is shutting down; the previous file is unchanged", type="server_error"
            ) from None
        except OSError as e:
            raise ApiError(
                500, f"saving failed ({e.strerror or e}); the previous file is unchanged", type="server_error"
            ) from None

    @bp.post("/v1/cache/restore")
    def restore():
        check_admin()
        body = _body(("name", "evict"))
        path = files.path_for(body.get("name"))
        evict = body.get("evict", False)
        if type(evict) is not bool:
            raise ApiError(400, f"evict must be true or false, got {evict!r}", "evict")
        if not os.path.isfile(path):
            raise ApiError(
                404, f"no cache file {os.path.basename(path)}", "name", code="cache_file_not_found"
            )
        try:
            return jsonify({"restored": True, **files.restore(path, evict=evict)})
        except CacheFileMismatch as e:
            why = files.mismatch(path).words
            raise ApiError(
                409, f"{why}; nothing was restored. Details: {e}", code="cache_file_mismatch"
            ) from None
        except CacheFileError as e:
            raise ApiError(422, f"{e}; nothing was restored", code="cache_file_corrupt") from None

    @bp.get("/v1/cache/files")
    def listing():
        check_admin()
        return jsonify({"object": "list", "data": files.files()})

    return bp


def install(app, engine, config, check_admin: Callable[[], None]) -> CacheFiles:
    """Register the endpoints, restore --cache-file, start periodic saves; the caller saves at exit."""
    files = CacheFiles(engine, config)
    app.register_blueprint(blueprint(files, check_admin))
    app.extensions["radixkv"]["cache_files"] = files
    files.restore_at_start()
    files.start_periodic()
    return files
