"""Why a cache file of another model or store was refused, in words, and whose mistake it likely was.

radixkv refuses a file whose identity (model class, config digest, weights digest) or KV layout
(block size, per-layer heads, head sizes, dtype; the recurrent-state snapshots' shapes and dtypes)
differs from the store's, naming the digests.
An operator needs the flag first: ``describe`` compares the file's manifest with the running
model and store and says which flag or file differs, before any digest.

``flag_mistake``: the difference is one a start-up flag makes (another model class or
configuration: ``--model``; another block size: ``--block-size``; another KV dtype:
``--dtype``). The demo then leaves the file in place and refuses to start, so restarting with
the right flag restores it (demo.cache_files). Other weights under the same configuration (a
new checkpoint at the same path, a fine-tune) are not a flag mistake: that file can never be
restored again.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_patch.identity import model_identity
from radixkv.persist.manifest import layout_of


@dataclass(frozen=True)
class Mismatch:
    """``words``: what differs, naming the flag; ``flag_mistake``: see the module docstring."""

    words: str
    flag_mistake: bool


def _short(class_path: object) -> str:
    return str(class_path).rsplit(".", 1)[-1]


def describe(manifest: dict, model, store, model_flag: str) -> Mismatch:
    """Compare a refused file's ``manifest`` with ``model`` and ``store`` (served as --model
    ``model_flag``). Reads the model's weights digest (a few ms to a second for large models)."""
    have, want = manifest.get("identity") or {}, model_identity(model)
    file_layout, layout = manifest.get("layout") or {}, layout_of(store.pool, store.states)
    flags, other = [], []
    if have.get("model_class") != want["model_class"]:
        flags.append(
            f"it was written for a {_short(have.get('model_class'))} model and --model {model_flag} "
            f"is a {_short(want['model_class'])}"
        )
    elif have.get("config_sha256") != want["config_sha256"]:
        flags.append(
            f"it was written for a {_short(want['model_class'])} of another configuration (sizes, "
            f"layers or vocabulary) than --model {model_flag}"
        )
    if file_layout.get("block_size") != layout["block_size"]:
        flags.append(
            f"--block-size: the file has blocks of {file_layout.get('block_size')} tokens, this "
            f"server {layout['block_size']}"
        )
    # KV layers and recurrent-state snapshots alike (a pure Mamba model has only the latter)
    parts = [*(file_layout.get("layers") or []), *(file_layout.get("states") or [])]
    file_dtypes = {part.get("dtype") for part in parts if isinstance(part, dict)}
    dtypes = {part["dtype"] for part in [*layout["layers"], *layout.get("states", [])]}
    if not flags and file_dtypes != dtypes:
        flags.append(
            f"--dtype: the file holds {'/'.join(sorted(map(str, file_dtypes)))} KV, this server "
            f"{'/'.join(sorted(dtypes))}"
        )
    if not flags and have.get("weights_sha256") != want["weights_sha256"]:
        other.append(
            f"it was written for other weights than --model {model_flag} has now (another checkpoint "
            "or fine-tune of the same configuration)"
        )
    if not flags and not other:
        other.append("it was written for another model or KV layout")
    return Mismatch("; ".join(flags or other), bool(flags))
