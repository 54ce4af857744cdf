"""``cuda_ext.validate``'s overlap test for written views, against a brute-force enumeration."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cuda_ext.validate import _self_overlap


def overlaps(shape, stride) -> bool:
    """Brute force: do two index tuples of the view reach one element?"""
    offsets = [sum(i * s for i, s in zip(idx, stride)) for idx in itertools.product(*map(range, shape))]
    return len(offsets) != len(set(offsets))


def test_verdict_is_sound_on_random_views():
    """The check never calls a view one-to-one when two of its indices share an element."""
    rng = random.Random(0)
    flagged = 0
    for _ in range(3000):
        shape = [rng.randrange(1, 4) for _ in range(4)]
        stride = [rng.randrange(0, 13) for _ in range(4)]
        verdict = _self_overlap(shape, stride)
        if verdict is None:
            assert not overlaps(shape, stride), (shape, stride)
        flagged += verdict is not None
    assert flagged > 500  # the sample held plenty of overlapping views


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t,
        lambda t: t[1:, :, 3:9, 1:5],
        lambda t: t[:, :, ::2],
        lambda t: t.permute(0, 2, 1, 3),
        lambda t: t.transpose(2, 3),
        lambda t: t[:, :1],
        lambda t: t[:, ::3, :, ::2].transpose(0, 1),
    ],
)
def test_views_of_a_plain_tensor_pass(view):
    t = view(torch.empty(3, 4, 10, 6))
    assert not overlaps(t.shape, t.stride())
    assert _self_overlap(t.shape, t.stride()) is None


def test_expanded_and_overlapping_views_are_named():
    base = torch.empty(200)
    assert _self_overlap((2, 3, 4, 5), (0, 20, 5, 1)) == "an expanded view (zero stride)"
    view = base.as_strided((2, 3, 4, 5), (60, 20, 4, 1))  # tokens 4 apart, rows 5 long
    assert _self_overlap(view.shape, view.stride()) == "a self-overlapping view"
    assert _self_overlap((1, 1, 1, 5), (0, 0, 0, 1)) is None  # size-1 dims may have any stride
