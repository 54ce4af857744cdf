"""Cache files of hybrid models (recurrent + attention layers, and pure Mamba): a document and two
questions in one process, save_cache, then a new process (tests/hybrid_restart.py) restores the file
with build_store(restore=) and asks a third question: equal to stock generate(), and it reads the
whole document, which needs the snapshot the second question took at the junction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hf_patch
from radixkv import CacheFileMismatch
from radixkv.persist.cache_file import read_manifest
from tests.hf_models import one_torch_thread  # noqa: F401  (autouse)
from tests.hybrid_models import build_hybrid
from tests.hybrid_restart import BS, DOC, QUESTIONS, ask, store_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("qwen3_5_text", "mamba2")  # Gated DeltaNet + attention; Mamba-2 alone (no KV layers)
DOC_BLOCKS = len(DOC) // BS * BS


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (cache file, SaveResult) after a document and two questions."""
    out = {}
    for name in FAMILIES:
        model = build_hybrid(name)
        store = store_for(model)
        cached = [ask(model, store, DOC + q).cached_tokens[0] for q in QUESTIONS[:2]]
        assert cached[0] == 0 and 0 < cached[1] < DOC_BLOCKS  # to the last interval snapshot only
        path = tmp_path_factory.mktemp(name) / "kv.safetensors"
        out[name] = path, hf_patch.save_cache(model, path, store)
    return out


@pytest.mark.slow  # ~9 s of CPU in the new process, 6.5 of them importing hf_patch (peft, transformers)
def test_a_new_process_restores_the_snapshots_and_reads_the_whole_document(saved):
    args = [str(x) for name in FAMILIES for x in (name, saved[name][0])]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.hybrid_restart", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["family"] for line in lines] == list(FAMILIES)
    for line in lines:
        result = saved[line["family"]][1]
        assert result.num_snapshots > 0 and result.state_bytes > 0
        assert (line["restored_blocks"], line["restored_snapshots"]) == (
            result.num_blocks,
            result.num_snapshots,
        )
        # The document's whole blocks: the junction snapshot (taken by the second question) came along.
        assert line["cached_tokens"] == [DOC_BLOCKS], line


def test_the_manifest_names_the_state_layout_and_another_models_file_is_refused(saved):
    path, _ = saved["qwen3_5_text"]
    layout = read_manifest(path)["layout"]
    model = build_hybrid("qwen3_5_text")
    spec = hf_patch.model_spec.model_layout(model)
    assert layout == hf_patch.identity.kv_layout(spec.specs, BS, spec.state_specs)
    assert [s["shape"] for s in layout["states"]] == [list(s.shape) for s in spec.state_specs]
    other = build_hybrid("mamba2")
    store = store_for(other)
    with pytest.raises(CacheFileMismatch, match="model_class"):
        hf_patch.restore_cache(other, path, store)
    assert store.stats()["cached_blocks"] == 0 and store.stats()["snapshots"] == 0
    store.check_invariants()


def test_a_plain_models_identity_digest_is_unchanged():
    """kv_layout adds ``states`` only for models with recurrent layers: a plain model's identity
    digest (its sidecar keys) is the one computed before format 3."""
    import torch

    from radixkv import LayerSpec

    specs = [LayerSpec(2, 16, 16, torch.float32, "cpu"), LayerSpec(1, 8, 4, torch.bfloat16, "cpu")]
    identity = {"model_class": "x.Y", "config_sha256": "c", "weights_sha256": "w"}
    layout = hf_patch.identity.kv_layout(specs, 16)
    assert "states" not in layout
    digest = hf_patch.identity.identity_digest(identity, layout).hex()
    assert digest == "363967f8d42c7069d381de7666b95bd2973ebad84c834bfb7e9fcee0982fe25e"
