"""Bucket rules: which tuned row a call of a given size uses.

A family's bucket is one integer per tuned row (the database's ``bucket`` column). For
prefill it is the longer sequence rounded up to a power of two; a family whose kernels
depend on two sizes (decode: context and batch) packs both into its own ``Buckets``
(``ContextBatchBuckets``), and its callers pass both sizes as a pair.

``bucket_of`` and ``nearest_bucket`` are plain functions with no imports, because
``tilegen emit --tuned`` copies their source into standalone modules: dispatch, the tuner
and emitted code follow one rule, not three copies of it.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable

__all__ = ["GPU_SIZES", "INTERPRETER_SIZES", "Buckets", "PowerOfTwoBuckets", "ContextBatchBuckets", "bucket_of",
           "nearest_bucket"]


def bucket_of(n, min_bucket=16):
    """The bucket of a size: the next power of two, at least ``min_bucket``."""
    return max(min_bucket, 1 << (int(n) - 1).bit_length())


def nearest_bucket(bucket, tuned):
    """The tuned bucket nearest to ``bucket`` in log2 distance, the larger one on a tie."""
    return min(tuned, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))


#: What ``tilegen tune`` tunes when no ``--sizes`` are given: a size every 2x from 512 to 32k on a GPU;
#: under the interpreter, which is slow, two tiny ones that finish in seconds.
GPU_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
INTERPRETER_SIZES = (16, 32)


class Buckets:
    """A family's bucket rule: ``of`` a size, ``nearest`` among tuned buckets, how the CLI reads one,
    and which sizes ``tilegen tune`` tunes by default (``tune_sizes``, and ``tune_batches`` for a
    rule whose bucket holds a batch too).

    Rules are values: two of one type with equal attributes are equal (a family's copy in the
    tuning worker must equal the family it came from).
    """

    #: What a bucket counts, for help texts and tables.
    unit = "size"
    #: What the second size counts when the bucket holds one (``tilegen tune --batches``); None: one size.
    batch_unit: str | None = None
    gpu_sizes: tuple[int, ...] = GPU_SIZES
    interpreter_sizes: tuple[int, ...] = INTERPRETER_SIZES

    def of(self, size: int) -> int:
        raise NotImplementedError

    def tune_sizes(self, on_gpu: bool) -> tuple[int, ...]:
        """The sizes ``tilegen tune`` tunes when given no ``--sizes``."""
        return self.gpu_sizes if on_gpu else self.interpreter_sizes

    def tune_batches(self, on_gpu: bool) -> tuple[int, ...]:
        """The batches ``tilegen tune`` tunes when given no ``--batches``; none for a rule of one size."""
        return ()

    def nearest(self, bucket: int, tuned: Iterable[int]) -> int:
        return nearest_bucket(bucket, list(tuned))

    def label(self, bucket: int) -> str:
        return str(bucket)

    def check(self, bucket: int) -> str | None:
        """``None`` when the rule gives ``bucket``, else why it never does (what a writer refuses)."""
        canonical = self.of(bucket)
        return None if canonical == bucket else f"its rule gives {canonical}"

    def cli_args(self, bucket: int) -> str:
        """The ``tilegen tune`` options that tune ``bucket``."""
        return f"--sizes {bucket}"

    def source(self) -> str:
        """Python source defining ``bucket_of(n)`` and ``nearest_bucket(bucket, tuned)`` for emitted modules."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.unit))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _sizes(name: str, sizes) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"{name}: expected positive ints, got {sizes!r}")
    return sizes


class PowerOfTwoBuckets(Buckets):
    """Sizes rounded up to a power of two, at least ``min_bucket``; nearest in log2 distance."""

    def __init__(self, unit: str, min_bucket: int = 16, *, gpu_sizes=GPU_SIZES, interpreter_sizes=INTERPRETER_SIZES):
        self.unit = unit
        self.min_bucket = min_bucket
        self.gpu_sizes = _sizes("gpu_sizes", gpu_sizes)
        self.interpreter_sizes = _sizes("interpreter_sizes", interpreter_sizes)

    def of(self, size: int) -> int:
        return bucket_of(size, self.min_bucket)

    def source(self) -> str:
        return f"MIN_BUCKET = {self.min_bucket}\n\n\n" + "\n\n".join(
            inspect.getsource(f).replace("min_bucket=16", "min_bucket=MIN_BUCKET")
            for f in (bucket_of, nearest_bucket)
        )


#: Low bits of a packed (context, batch) bucket: log2 of the batch bucket, plus one.
_BATCH_BITS = 4
_BATCH_MASK = (1 << _BATCH_BITS) - 1


class ContextBatchBuckets(Buckets):
    """Two sizes in one bucket: the longest context and the batch (decode). ``of`` takes ``(context, batch)``.

    Encoding: ``bucket = context_bucket | (log2(batch_bucket) + 1)``. The context bucket is the
    context rounded up to a power of two, at least ``min_bucket`` (16 or more), so its low 4 bits
    are zero; they hold log2 of the batch bucket (the batch rounded up to a power of two) plus
    one: 1..15, batch buckets 1 to 2**14. 4096 ctx x 64 seqs is ``4096 | 7 = 4103``. The plus
    one keeps a packed bucket apart from a bare power of two, the context-only bucket of a row
    tuned before the batch was part of it: such a row is refused by name, not read as batch 1.
    Contexts past 2**30 share its bucket and batches past 2**14 share theirs, so the largest
    bucket, ``2**30 | 15``, fits the column's signed 32 bits. Integer order is context first,
    then batch.

    ``nearest``: the tuned bucket nearest in log2 of the context, then (among those) in log2 of
    the batch, the larger on a tie in either. Context first because it sets what a program
    streams (the key block count the knobs are tuned for), while the split rule already adapts
    the grid to the batch; a weighted sum would let a row of the right batch but another
    context win, which a decode of 128k tokens should never take from a 1k row.
    """

    max_context = 1 << 30
    max_batch = 1 << (_BATCH_MASK - 1)

    def __init__(self, unit: str, batch_unit: str, min_bucket: int = 16, *, gpu_sizes=GPU_SIZES,
                 interpreter_sizes=INTERPRETER_SIZES, gpu_batches=(1, 8, 64), interpreter_batches=(1, 4)):
        if min_bucket < 1 << _BATCH_BITS or min_bucket & (min_bucket - 1):
            raise ValueError(f"min_bucket: expected a power of two of at least {1 << _BATCH_BITS}, got {min_bucket}")
        self.unit = unit
        self.batch_unit = batch_unit
        self.min_bucket = min_bucket
        self.gpu_sizes = _sizes("gpu_sizes", gpu_sizes)
        self.interpreter_sizes = _sizes("interpreter_sizes", interpreter_sizes)
        self.gpu_batches = _sizes("gpu_batches", gpu_batches)
        self.interpreter_batches = _sizes("interpreter_batches", interpreter_batches)

    def tune_batches(self, on_gpu: bool) -> tuple[int, ...]:
        return self.gpu_batches if on_gpu else self.interpreter_batches

    def of(self, size: tuple[int, int]) -> int:
        try:
            context, batch = (operator.index(n) for n in size)
        except (TypeError, ValueError):
            raise TypeError(f"size: expected a ({self.unit}, {self.batch_unit}) pair of ints, got {size!r}") from None
        if context < 0 or batch < 0:
            raise ValueError(f"size: expected a {self.unit} and {self.batch_unit} >= 0, got {size!r}")
        # An empty batch or context (a step with nothing to attend) buckets with the smallest.
        return self.pack(min(bucket_of(max(context, 1), self.min_bucket), self.max_context),
                         min(bucket_of(max(batch, 1), 1), self.max_batch))

    def pack(self, context_bucket: int, batch_bucket: int) -> int:
        """The bucket of a context bucket and a batch bucket (each a power of two in range)."""
        return context_bucket | batch_bucket.bit_length()

    def unpack(self, bucket: int) -> tuple[int, int]:
        """``(context bucket, batch bucket)``; ``ValueError`` (saying why) for an int this rule never gives."""
        reason = self.check(bucket)
        if reason is not None:
            raise ValueError(f"bucket: {bucket} is not a {self.unit} x {self.batch_unit} bucket: {reason}")
        return bucket & ~_BATCH_MASK, 1 << ((bucket & _BATCH_MASK) - 1)

    def check(self, bucket: int) -> str | None:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            return "expected a positive integer"
        context, batch_bits = bucket & ~_BATCH_MASK, bucket & _BATCH_MASK
        if context & (context - 1) or not self.min_bucket <= context <= self.max_context:
            return (f"its {self.unit} part {context} is not a power of two from {self.min_bucket} to "
                    f"{self.max_context}; a bucket is context | (log2(batch) + 1), e.g. "
                    f"{self.pack(4096, 64)} for {self.label(self.pack(4096, 64))}")
        if batch_bits == 0:
            return (f"it holds a {self.unit} of {context} and no batch, as rows tuned before the batch was part "
                    f"of the bucket do; re-key such a row with the batch it measured, e.g. "
                    f"{self.pack(context, 64)} for {self.label(self.pack(context, 64))}")
        return None

    def nearest(self, bucket: int, tuned: Iterable[int]) -> int:
        def logs(b: int) -> tuple[int, int]:
            # A stored bucket this rule never gives (a context-only row) still has a place: batch bits 0.
            return (b & ~_BATCH_MASK).bit_length(), b & _BATCH_MASK

        context, batch = logs(bucket)
        return min(tuned, key=lambda b: (abs(logs(b)[0] - context), abs(logs(b)[1] - batch), -b))

    def label(self, bucket: int) -> str:
        if self.check(bucket) is not None:
            return str(bucket)
        context, batch = self.unpack(bucket)
        return f"{context} ctx x {batch} seq{'' if batch == 1 else 's'}"

    def cli_args(self, bucket: int) -> str:
        if self.check(bucket) is not None:
            return f"--sizes {bucket & ~_BATCH_MASK}"
        context, batch = self.unpack(bucket)
        return f"--sizes {context} --batches {batch}"

    def source(self) -> str:
        raise NotImplementedError(
            f"{self.unit} x {self.batch_unit} buckets have no copy for standalone modules: no family with them "
            f"has an `emit --tuned` entry point"
        )
