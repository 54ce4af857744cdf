"""Commit the pages of memory about to be written, in one system call.

A restore into a new store's pool is the first write to that memory: with 4 KiB pages, one
page fault per page, taken inside the read's copy out of the page cache. Linux (5.14+) commits
a whole range at once with ``madvise(MADV_POPULATE_WRITE)``: the same zeroed pages, without a
fault's trap and return per page. Elsewhere, or on an older kernel, this does nothing and the
read faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
PAGE = mmap.PAGESIZE  # madvise takes ranges aligned to it (4 KiB on x86, 16/64 KiB on some ARM)

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def populate(view: memoryview) -> bool:
    """Commit the pages under ``view`` (writable, C-contiguous) before it is written; True if
    the kernel did. Only whole pages inside the view are touched: a partial page at either end
    belongs to memory beside it and is left to fault as usual."""
    global _madvise
    if _madvise is None or view.readonly or len(view) < 2 * PAGE:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = -(-address // PAGE) * PAGE
    end = (address + len(view)) // PAGE * PAGE
    if end <= start:
        return False
    if _madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == 22:  # EINVAL: a kernel without it; stop asking
        _madvise = None
    return False
