"""Gradient buckets as PyTorch's DistributedDataParallel forms them: pure logic, no device.

Gradients become ready in the reverse of the order the forward pass used the parameters, so buckets are filled
from the last parameter backwards: the first bucket all-reduced holds the last layers' gradients, and its
all-reduce overlaps the rest of the backward pass.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CAP_BYTES = 25 * 1024 * 1024   # DDP's bucket_cap_mb=25


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: ``indices`` into the forward-order parameter list (in the order their gradients become
    ready, i.e. decreasing) and their total ``nbytes``.

    >>> Bucket(indices=(2, 1), nbytes=96)
    Bucket(indices=(2, 1), nbytes=96)
    """

    indices: tuple[int, ...]
    nbytes: int


def bucket_plan(sizes: Sequence[int], cap_bytes: int = DEFAULT_CAP_BYTES,
                first_cap_bytes: int | None = None) -> list[Bucket]:
    """Buckets for parameters of ``sizes`` bytes (in forward order), in the order they fill during backward.

    Walking the parameters from the last to the first, each joins the current bucket unless that would take the
    bucket over ``cap_bytes``; then a new bucket starts. A parameter larger than the cap gets a bucket of its own
    (the only way a bucket exceeds the cap). ``first_cap_bytes`` caps the first bucket only (DDP makes it small,
    1 MiB, so that the first all-reduce starts early); by default it is ``cap_bytes``. Every parameter is in
    exactly one bucket; reading the buckets in order gives the indices ``len(sizes) - 1, ..., 0``. Zero-size
    parameters join the current bucket. Unlike DDP, buckets never exceed the cap by their last parameter, and
    dtypes are not separated (pass one dtype's sizes at a time).

    >>> [b.indices for b in bucket_plan([40, 40, 40, 100, 8], cap_bytes=100)]
    [(4,), (3,), (2, 1), (0,)]
    >>> bucket_plan([300, 20, 20], cap_bytes=100, first_cap_bytes=30)
    [Bucket(indices=(2,), nbytes=20), Bucket(indices=(1,), nbytes=20), Bucket(indices=(0,), nbytes=300)]
    """
    sizes = [_size(s, i) for i, s in enumerate(sizes)]
    cap = _cap(cap_bytes, "cap_bytes")
    first = cap if first_cap_bytes is None else _cap(first_cap_bytes, "first_cap_bytes")
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        limit = first if not buckets else cap
        if current and total + sizes[i] > limit:
            buckets.append(Bucket(tuple(current), total))
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        buckets.append(Bucket(tuple(current), total))
    return buckets


def _size(value, i):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"bucket_plan expects sizes to be ints >= 0 (bytes), got {value!r} at index {i}")
    return int(value)


def _cap(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"bucket_plan expects {name} to be an int >= 1 (bytes), got {value!r}")
    return int(value)
