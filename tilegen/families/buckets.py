"""Bucket rules: which tuned row a call of a given size uses.

A family's bucket is one integer per tuned row (the database's ``bucket`` column). For
prefill it is the longer sequence rounded up to a power of two; a family whose kernels
depend on two sizes (decode: context and batch) packs both into its own ``Buckets``.

``bucket_of`` and ``nearest_bucket`` are plain functions with no imports, because
``tilegen emit --tuned`` copies their source into standalone modules: dispatch, the tuner
and emitted code follow one rule, not three copies of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

__all__ = ["Buckets", "PowerOfTwoBuckets", "bucket_of", "nearest_bucket"]


def bucket_of(n, min_bucket=16):
    """The bucket of a size: the next power of two, at least ``min_bucket``."""
    return max(min_bucket, 1 << (int(n) - 1).bit_length())


def nearest_bucket(bucket, tuned):
    """The tuned bucket nearest to ``bucket`` in log2 distance, the larger one on a tie."""
    return min(tuned, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))


class Buckets:
    """A family's bucket rule: ``of`` a size, ``nearest`` among tuned buckets, and how the CLI reads one."""

    #: What a bucket counts, for help texts and tables.
    unit = "size"

    def of(self, size: int) -> int:
        raise NotImplementedError

    def nearest(self, bucket: int, tuned: Iterable[int]) -> int:
        return nearest_bucket(bucket, list(tuned))

    def label(self, bucket: int) -> str:
        return str(bucket)

    def source(self) -> str:
        """Python source defining ``bucket_of(n)`` and ``nearest_bucket(bucket, tuned)`` for emitted modules."""
        raise NotImplementedError


class PowerOfTwoBuckets(Buckets):
    """Sizes rounded up to a power of two, at least ``min_bucket``; nearest in log2 distance."""

    def __init__(self, unit: str, min_bucket: int = 16):
        self.unit = unit
        self.min_bucket = min_bucket

    def of(self, size: int) -> int:
        return bucket_of(size, self.min_bucket)

    def source(self) -> str:
        return f"MIN_BUCKET = {self.min_bucket}\n\n\n" + "\n\n".join(
            inspect.getsource(f).replace("min_bucket=16", "min_bucket=MIN_BUCKET")
            for f in (bucket_of, nearest_bucket)
        )
