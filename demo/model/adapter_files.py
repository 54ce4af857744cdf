"""Where an adapter's files come from: a local directory, or a bounded download of a Hub id.

    directory = local_files("someorg/sql-lora", timeout=120)   # AdapterError 404 / 502 / 504

Run before the model lock is taken (demo.model.adapters): generation goes on meanwhile.

- A path that exists is used as it is (it must be a directory).
- A path that looks local and does not exist is a 404 at once, without asking the Hub:
  absolute, starting with ``.`` or ``~``, holding a backslash or more than one ``/``, or
  whose first component is a directory here (``adapters/sq1`` beside an ``adapters/``
  folder: a mistyped directory, not a repository ``adapters`` owns).
- Anything else is a Hub id: its adapter files (config and weights only) are downloaded by
  ``huggingface_hub.snapshot_download`` in a thread of its own, waited for at most ``timeout``
  seconds (the client's own retries included: 1+2+4+8+8 s on a host that does not answer),
  and logged with their size and time. Past the timeout the request is answered (504) and the
  download is left to finish or fail on its own; nothing is loaded from it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from demo.errors import ApiError

log = logging.getLogger(__name__)

# An adapter's own files: what PEFT reads (config, weights); never code, never a whole repo.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ApiError):
    """A load or unload that cannot be done; an API error (vLLM's statuses: 400, 404)."""


def looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a directory on this machine (see the module's rules)."""
    if os.path.isabs(path) or path.startswith((".", "~")) or "\\" in path or path.count("/") > 1:
        return True
    first = path.split("/", 1)[0]
    return "/" in path and os.path.isdir(first)


def local_files(path: str, timeout: float) -> str:
    """A local directory holding the adapter ``path`` names; AdapterError when there is none:
    404 (no such directory or repository), 502 (the Hub failed), 504 (past ``timeout`` s)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise AdapterError(400, f"{path!r} is a file, not an adapter directory", "lora_path")
        return path
    if looks_local(path):
        raise AdapterError(
            404, f"No adapter found at {path!r}: no such directory", "lora_path", "adapter_not_found"
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError as e:
        raise AdapterError(
            404,
            f"No adapter found at {path!r}: neither a directory nor a Hub id ({e})",
            "lora_path",
            "adapter_not_found",
        ) from None
    return _download(path, timeout)


def _download(repo_id: str, timeout: float) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["path"] = snapshot_download(repo_id, allow_patterns=list(ADAPTER_FILES))
        except BaseException as e:  # handed to the waiting request
            outcome["error"] = e

    started = time.monotonic()
    log.info("downloading adapter %s from the Hub (at most %gs)", repo_id, timeout)
    worker = threading.Thread(target=run, name=f"radixkv-adapter-download-{repo_id}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        log.warning("downloading adapter %s: no answer within %gs; not loaded", repo_id, timeout)
        raise AdapterError(
            504,
            f"downloading adapter {repo_id!r} from the Hub took longer than {timeout:g} s",
            "lora_path",
            "adapter_download_timeout",
        )
    error = outcome.get("error")
    if isinstance(error, (RepositoryNotFoundError, RevisionNotFoundError)):
        raise AdapterError(
            404, f"No adapter found at {repo_id!r} on the Hub", "lora_path", "adapter_not_found"
        )
    if isinstance(error, LocalEntryNotFoundError):  # offline mode, or the Hub cannot be reached
        raise AdapterError(
            502, f"cannot download adapter {repo_id!r}: {error}", "lora_path", "adapter_download_failed"
        )
    if error is not None:
        raise AdapterError(
            502,
            f"cannot download adapter {repo_id!r}: {type(error).__name__}: {error}",
            "lora_path",
            "adapter_download_failed",
        )
    directory = outcome["path"]
    size = sum(
        os.path.getsize(os.path.join(directory, f))
        for f in ADAPTER_FILES
        if os.path.isfile(os.path.join(directory, f))
    )
    log.info(
        "downloaded adapter %s: %.1f MiB in %.1fs, in %s",
        repo_id,
        size / 2**20,
        time.monotonic() - started,
        directory,
    )
    return directory
