"""hf_patch.attention_backend: torch's cuDNN attention backend off for a CUDA model in the demo
and batchrun (it builds a graph per key length: every decode step), kept with RADIXKV_CUDNN_SDPA=1."""

from __future__ import annotations

import pytest
import torch

from hf_patch.attention_backend import ENV, avoid_cudnn_sdpa


@pytest.fixture
def cudnn_on(monkeypatch):
    """torch's flag on for the test, and back to what it was after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.delenv(ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_cuda_device_turns_it_off_and_a_cpu_leaves_it(cudnn_on):
    assert avoid_cudnn_sdpa("cpu") is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert avoid_cudnn_sdpa(torch.device("cuda", 1)) is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert avoid_cudnn_sdpa("cuda") is True  # again: a no-op
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_environment_keeps_it_or_is_refused_naming_the_variable(cudnn_on, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert avoid_cudnn_sdpa("cuda") is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=f"{ENV} must be 0 or 1, got 'yes'"):
        avoid_cudnn_sdpa("cuda")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_demo_asks_with_the_device_its_weights_are_on(monkeypatch):
    from demo.api import app
    from demo.config import Config

    seen = []
    monkeypatch.setattr(app, "avoid_cudnn_sdpa", seen.append)
    engine = app.build_engine(Config(model="builtin-tiny", device="cpu", cache_tokens=1 << 12))
    try:
        assert [torch.device(d).type for d in seen] == ["cpu"]
    finally:
        engine.shutdown(wait=10)
