"""Which modules of a model are PEFT's: tuner layers and auxiliary wrappers, and the adapter
tensors they hold. No peft import until a model is asked about while peft is loaded (a tuner
layer is made by peft, so before that no module is one).
"""

from __future__ import annotations

import functools
import sys

import torch


@functools.cache
def _peft_types() -> tuple[type | None, type | None]:
    """(BaseTunerLayer, AuxiliaryTrainingWrapper) of peft, imported once, the first time a model is
    asked about while peft is loaded. Before that no module can be one of them (a tuner layer is
    made by peft), so hf_patch does not import peft (6 s of a subprocess's start here)."""
    try:  # peft is optional: without it no model has tuner layers
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - exercised only where peft is absent
        BaseTunerLayer = None
    try:  # modules_to_save / trainable tokens: per-adapter copies beside the tuner layers
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - peft absent, or older than these wrappers
        AuxiliaryTrainingWrapper = None
    return BaseTunerLayer, AuxiliaryTrainingWrapper


def _tuner_type():
    return _peft_types()[0] if "peft" in sys.modules else None


def _wrapper_type():
    return _peft_types()[1] if "peft" in sys.modules else None


def _base_part(layer: torch.nn.Module) -> str:
    """The attribute under which a wrapping layer keeps the model's own module."""
    return (
        "original_module"
        if (wrapper := _wrapper_type()) is not None and isinstance(layer, wrapper)
        else "base_layer"
    )


def is_tuner_layer(module: torch.nn.Module) -> bool:
    tuner = _tuner_type()
    return tuner is not None and isinstance(module, tuner)


def is_adapter_holder(module: torch.nn.Module) -> bool:
    """A tuner layer or one of PEFT's auxiliary wrappers (``modules_to_save`` copies, trainable
    tokens): a module holding adapter weights beside the model's own module."""
    wrapper = _wrapper_type()
    return is_tuner_layer(module) or (wrapper is not None and isinstance(module, wrapper))


def adapter_tensors(layer: torch.nn.Module):
    """``(name, tensor)`` of a tuner layer's or wrapper's own adapter parameters and buffers (not
    those of the model's module it wraps)."""
    own = _base_part(layer)
    for tname, t in (*layer.named_parameters(), *layer.named_buffers()):
        if tname.split(".")[0] != own:
            yield tname, t
