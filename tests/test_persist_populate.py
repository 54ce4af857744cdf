"""radixkv.persist.populate: a restore commits the pool pages it reads into in one call."""

import mmap
import resource
import sys

import pytest
import torch

from radixkv.persist import populate as populate_mod
from radixkv.persist.populate import PAGE, populate

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _small_pages(nbytes: int) -> torch.Tensor:
    """New memory in the system's small pages (no transparent huge pages, whatever the
    system's setting: one fault per page when first written), as a uint8 tensor."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


@linux
def test_populated_memory_takes_no_faults_when_written():
    if populate_mod._madvise is None:
        pytest.fail("libc's madvise was not found on Linux")
    nbytes = 64 << 20  # 16,384 pages of 4 KiB: far above anything else this test could fault in
    pages = nbytes // PAGE
    t = _small_pages(nbytes)
    view = memoryview(t.numpy()).cast("B")
    assert populate(view)
    before = _minor_faults()
    t.fill_(7)
    faults = _minor_faults() - before
    assert faults < pages // 16, f"{faults} minor faults writing {pages} pages populated beforehand"
    # and the same write into memory not populated does fault (the check above can fail)
    u = _small_pages(nbytes)
    before = _minor_faults()
    u.fill_(7)
    assert _minor_faults() - before > pages // 2


@linux
def test_populate_keeps_what_the_memory_holds_and_its_neighbours():
    t = torch.arange(1 << 22, dtype=torch.int32).view(torch.uint8)  # 16 MiB, every page written
    expect = t.clone()
    view = memoryview(t.numpy()).cast("B")
    assert populate(view[PAGE // 2 : -PAGE // 2])  # partial pages at both ends
    assert torch.equal(t, expect)


def test_small_or_read_only_views_are_left_alone():
    t = torch.zeros(PAGE, dtype=torch.uint8)
    assert not populate(memoryview(t.numpy()).cast("B"))
    assert not populate(memoryview(bytes(4 * PAGE)))
