"""Paged KV gather/scatter between a block pool and per-layer contiguous K/V.

Provisional entry points (the custom-op registration replaces these bodies, keeping the
signatures; see docs/design.md).
"""

from cuda_ext.reference import paged_gather_ref as paged_gather
from cuda_ext.reference import paged_scatter_ref as paged_scatter

__all__ = ["paged_gather", "paged_scatter"]
