"""The KV cache on disk: restore at start, save at shutdown / periodically, admin endpoints.

    --cache-file PATH      restored at start when present; saved on SIGTERM / Ctrl-C and,
                           with --cache-save-every S, every S seconds
    --cache-dir DIR        named files for the admin endpoints below

POST /v1/cache/save    {"name": optional}  -> the file written (default: --cache-file)
POST /v1/cache/restore {"name": optional}  -> what was restored, dropped, already cached
GET  /v1/cache/files                       -> files in --cache-dir (and --cache-file): size, manifest

All three need the admin token, like /v1/cache/flush. A name is a plain file name inside
--cache-dir (letters, digits, '.', '_', '-'; no separators, no '..'): anything else is a 400.

A cache file that is damaged or was saved for another model never blocks a start: it is
moved aside (``PATH.rejected-<time>``), the reason is logged, and the server starts cold.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from flask import Blueprint, jsonify, request

import hf_patch
from demo.errors import ApiError
from radixkv import CacheFileError, CacheFileMismatch
from radixkv.persist.cache_file import read_manifest

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class CacheFiles:
    """Saves and restores ``engine``'s store for one server (with reuse off there is none: 409)."""

    def __init__(self, engine, config) -> None:
        self.engine = engine
        self.cache_file = config.cache_file
        self.cache_dir = config.cache_dir
        self.every = config.cache_save_every
        self._lock = threading.Lock()  # one save or restore at a time: no two writers of one file
        self._stop = threading.Event()
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

    def save(self, path: str | None = None) -> dict:
        store = self._store()
        path = path or self.path_for(None)
        with self._lock:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            started = time.perf_counter()
            result = hf_patch.save_cache(self.engine.model, path, store)
        out = dataclasses.asdict(result)
        out["seconds"] = round(time.perf_counter() - started, 3)
        return out

    def restore(self, path: str) -> dict:
        store = self._store()
        with self._lock:
            started = time.perf_counter()
            result = hf_patch.restore_cache(self.engine.model, path, store)
        out = dataclasses.asdict(result)
        out["seconds"] = round(time.perf_counter() - started, 3)
        return out

    def restore_at_start(self) -> dict | None:
        """Restore --cache-file if it exists; a bad file is moved aside and logged, never raised."""
        path = self.cache_file
        if not path or self.engine.store is None or not os.path.exists(path):
            return None
        try:
            result = self.restore(path)
        except (CacheFileError, OSError) as e:
            aside = f"{path}.rejected-{time.strftime('%Y%m%dT%H%M%S')}"
            try:
                os.replace(path, aside)
                log.warning("cache file %s refused (%s); moved to %s, starting cold", path, e, aside)
            except OSError as move_error:
                log.warning(
                    "cache file %s refused (%s) and not moved (%s); starting cold", path, e, move_error
                )
            return None
        except Exception:  # a bug of ours must not block a restart either; the file stays for a look
            log.exception("restoring %s failed; starting cold (the file is left in place)", path)
            return None
        log.info(
            "restored %d cached tokens from %s in %.2fs (%d already cached, %d dropped for room)",
            result["restored_tokens"],
            path,
            result["seconds"],
            result["duplicate_tokens"],
            result["dropped_tokens"],
        )
        return result

    def save_at_exit(self) -> None:
        """Final save to --cache-file (SIGTERM / Ctrl-C); errors are logged, the old file kept."""
        self.stop()
        if not self.cache_file or self.engine.store is None:
            return
        try:
            result = self.save(self.cache_file)
            log.info(
                "saved %d cached tokens to %s in %.2fs",
                result["num_tokens"],
                self.cache_file,
                result["seconds"],
            )
        except Exception:
            log.exception("saving the cache to %s failed; the previous file is unchanged", self.cache_file)

    # -- periodic saves ------------------------------------------------------------------------
    def start_periodic(self) -> None:
        if not self.every or not self.cache_file or self.engine.store is None:
            return
        self._thread = threading.Thread(target=self._periodic, name="radixkv-cache-save", daemon=True)
        self._thread.start()

    def _periodic(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.save(self.cache_file)
            except Exception:  # a full disk must not kill the thread: the next period retries
                log.exception("periodic save to %s failed; the previous file is unchanged", self.cache_file)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

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


def _name_from_body() -> object:
    data = request.get_data(cache=False)
    if not data.strip():
        return None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if body is None:
        return None
    if not isinstance(body, dict) or set(body) - {"name"}:
        raise ApiError(400, 'the body must be a JSON object with at most a "name" field')
    return body.get("name")


def blueprint(files: CacheFiles, check_admin: Callable[[], None]) -> Blueprint:
    """``check_admin()`` raises the API's 401/403/429 (the app's admin check, under its
    failed-authentication throttle, so these endpoints cannot be used to guess the token)."""
    bp = Blueprint("radixkv_cache_files", __name__)

    @bp.post("/v1/cache/save")
    def save():
        check_admin()
        path = files.path_for(_name_from_body())
        try:
            return jsonify({"saved": True, **files.save(path)})
        except OSError as e:
            raise ApiError(
                500, f"saving failed ({e.strerror or e}); the previous file is unchanged", type="server_error"
            ) from None

    @bp.post("/v1/cache/restore")
    def restore():
        check_admin()
        path = files.path_for(_name_from_body())
        if not os.path.isfile(path):
            raise ApiError(
                404, f"no cache file {os.path.basename(path)}", "name", code="cache_file_not_found"
            )
        try:
            return jsonify({"restored": True, **files.restore(path)})
        except CacheFileMismatch as e:
            raise ApiError(409, f"{e}; nothing was restored", code="cache_file_mismatch") from None
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
