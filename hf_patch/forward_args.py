"""The argument names a model's ``forward`` takes, memoised per forward function.

generate() and hf_patch ask ``inspect.signature(model.forward)`` which arguments a model takes
(its cache's name, ``logits_to_keep``, ``position_ids``, ``mm_encoder_outputs``); one signature
read costs ~25 us on this project's 2-core machine, and a generate() call asked several times:
a fixed cost per call. The names are kept per function: a bound method's ``__func__`` (the
class's forward), or the callable an instance holds itself (accelerate's hooks, a user's
wrapper), which then has its own entry.
"""

from __future__ import annotations

import inspect
import threading

# id(function) -> (the function, its parameter names); the function is kept with its entry so
# that its id cannot be reused by another object while the entry lives.
_signatures: dict[int, tuple[object, frozenset[str]]] = {}
_MAX_SIGNATURES = 512
_lock = threading.Lock()


def forward_parameters(model) -> frozenset[str]:
    """The parameter names of ``model.forward``, as ``inspect.signature`` gives them (empty when
    it cannot be read)."""
    forward = model.forward
    fn = getattr(forward, "__func__", forward)
    known = _signatures.get(id(fn))
    if known is not None and known[0] is fn:
        return known[1]
    try:
        names = frozenset(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        names = frozenset()
    with _lock:
        if len(_signatures) >= _MAX_SIGNATURES:
            _signatures.clear()
        _signatures[id(fn)] = (fn, names)
    return names
