"""Paged KV gather/scatter between a block pool and per-layer K/V tensors (see docs/design.md).

``paged_gather`` / ``paged_scatter`` call the custom ops ``torch.ops.radixkv.paged_gather`` /
``paged_scatter``: the pure-torch reference on CPU, one fused kernel launch for all layers on
CUDA (built on first use; the reference when it cannot be built or
``RADIXKV_FORCE_REFERENCE=1`` / ``set_force_reference(True)``). Importing never compiles.
"""

from cuda_ext.build import backend_for, force_reference, set_force_reference, unavailable_reason
from cuda_ext.ops import paged_gather, paged_scatter
from cuda_ext.reference import paged_gather_ref, paged_scatter_ref

__all__ = [
    "backend_for",
    "force_reference",
    "paged_gather",
    "paged_gather_ref",
    "paged_scatter",
    "paged_scatter_ref",
    "set_force_reference",
    "unavailable_reason",
]
