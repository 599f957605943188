"""``tilegen.PagedKVCache``: keys and values in fixed-size pages, found through a page table.

Layout (FlashInfer's "NHD" paged layout):

- ``k_pages``, ``v_pages``: ``[num_pages, page_size, kv_heads, head_dim]`` (``head_dim_v`` for
  V), one dtype and device; a page holds ``page_size`` consecutive tokens of one sequence.
- the page table, in CSR form over the batch: sequence ``b`` owns pages
  ``indices[indptr[b]:indptr[b + 1]]`` in token order, and its last page holds
  ``last_page_len[b]`` tokens (``1..page_size``; a sequence with no page has length 0 and its
  ``last_page_len`` is ignored). All three are int32 on the pages' device.

FP8 pages (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, as vLLM, FlashInfer and
FlashAttention-3 store them) come with ``k_scale`` and ``v_scale``: fp32 tensors on the pages'
device, of one element (per tensor) or ``[kv_heads]`` (per KV head); the value a kernel sees is
the stored one times its scale. Pages of fp16, bf16 or fp32 take no scales. ``PagedKVCache.empty``
allocates a cache of either kind; ``tilegen.append_kv`` quantizes new tokens into FP8 pages.

So token ``t`` of sequence ``b`` lives at page ``indices[indptr[b] + t // page_size]``, slot
``t % page_size``, and sequence ``b`` holds
``(indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b]`` tokens.

Checks. Building a cache checks shapes, dtypes, devices, contiguity and the page size on the
host, on every construction (cheap). The page table's values (monotone ``indptr``, indices
inside the cache, ``last_page_len`` in range) live on the device; ``validate()`` checks them
there at the cost of one synchronization, and ``TILEGEN_DEBUG=1`` makes every construction call
it. FP8 scales must be finite and positive: checked on every construction when they are on the
CPU (no synchronization), by ``validate()`` when they are on a GPU. Without the debug checks the
kernels clamp what they read into the tensors (``indptr`` into ``indices``, page ids into the
pages, ``last_page_len`` into ``1..page_size``): a wrong value gives a wrong answer for its
sequence, never an access outside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch

from tilegen import env
from tilegen.dtypes import SPEC_DTYPES, SPEC_KV_DTYPES

__all__ = ["PagedKVCache", "PAGE_SIZES"]

#: Page sizes the paged kernels are generated for.
PAGE_SIZES = (1, 8, 16, 32, 64, 128)

# Token positions are int32 inside the kernels.
_MAX_TOKENS = (1 << 31) - 1


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """K/V pages and their page table (see the module docstring for the layout)."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k, v = self.k_pages, self.v_pages
        for name, t in (("k_pages", k), ("v_pages", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a [num_pages, page_size, kv_heads, head_dim] tensor, "
                                 f"got {_describe(t)}")
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v_pages: pages, page size and heads {tuple(v.shape[:3])} differ from k_pages' "
                             f"{tuple(k.shape[:3])}")
        if v.dtype != k.dtype or v.device != k.device:
            raise ValueError(f"v_pages: {v.dtype} on {v.device} differs from k_pages' {k.dtype} on {k.device}")
        self._check_scales()
        if k.shape[1] not in PAGE_SIZES:
            raise ValueError(f"k_pages: page size {k.shape[1]} is not supported; expected one of {PAGE_SIZES}")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("k_pages, v_pages: the head dim must be unit-stride")
        for name in ("indptr", "indices", "last_page_len"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
                raise ValueError(f"{name}: expected a 1-d int32 tensor, got {_describe(t)}")
            if t.device != k.device:
                raise ValueError(f"{name}: on {t.device} while the pages are on {k.device}")
            if not t.is_contiguous():
                # The kernels read entry i at address + i: a strided or expanded view would be read
                # past its storage.
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if self.indptr.numel() < 1:
            raise ValueError("indptr: expected batch + 1 entries, got none")
        if self.last_page_len.numel() != self.indptr.numel() - 1:
            raise ValueError(f"last_page_len: expected {self.indptr.numel() - 1} entries (one per sequence of "
                             f"indptr), got {self.last_page_len.numel()}")
        if self.indices.numel() and not k.shape[0]:
            raise ValueError(f"k_pages: no page, but indices has {self.indices.numel()} entries; expected at "
                             "least one page")
        if self.indices.numel() * k.shape[1] > _MAX_TOKENS:
            raise ValueError(f"indices: {self.indices.numel()} pages of {k.shape[1]} tokens exceed the "
                             f"{_MAX_TOKENS} token positions of the kernels' int32 arithmetic")
        # The extents the kernels clamp the page table into; a replayed launch is keyed by them.
        object.__setattr__(self, "_bounds", (self.indices.shape[0], k.shape[0]))
        # The launchers' trailing arguments (none for pages that are not FP8), and their sizes (one or per
        # head), which choose how the kernels index them and so key a plan.
        object.__setattr__(self, "_scales", () if self.k_scale is None else (self.k_scale, self.v_scale))
        object.__setattr__(self, "_scale_kinds", tuple(t.numel() for t in self._scales))
        # What a decode or prefill plan fixes, read once here: a run per layer compares this tuple instead of
        # building it from four tensors' shapes (half a microsecond of a short call's host time).
        object.__setattr__(self, "_layout", (k.shape[1], k.shape[2], k.shape[3], v.shape[3],
                                             self.indptr.shape[0], k.dtype, self._scale_kinds))
        # Likewise what a cascade plan fixes (the batch aside: its levels are its own), and the pages' extents and
        # strides, which key a prefill's replayed launches: a run compares one tuple and reads these where it read
        # six values.
        object.__setattr__(self, "_pages_layout", (k.shape[1], k.shape[2], k.shape[3], v.shape[3], k.dtype,
                                                   self._scale_kinds))
        object.__setattr__(self, "_pages_key", (k.shape[0], k.stride(), v.stride()))
        if env.debug():
            self.validate()

    def with_pages(self, k_pages: torch.Tensor, v_pages: torch.Tensor) -> PagedKVCache:
        """This page table and these scales over other pages, such as another layer's. Pages of this cache's
        shapes, strides, dtype and device take its checks and derived values as they are (one comparison, for
        a call per layer); any others are checked as a new cache's are."""
        own = self.__dict__.get("_pages_signature") or _pages_signature(self.k_pages, self.v_pages)
        if isinstance(k_pages, torch.Tensor) and isinstance(v_pages, torch.Tensor) \
                and _pages_signature(k_pages, v_pages) == own:
            same = object.__new__(PagedKVCache)
            same.__dict__.update(self.__dict__, k_pages=k_pages, v_pages=v_pages)
            same.__dict__.pop("_pages_signature", None)
            return same
        return PagedKVCache(k_pages, v_pages, self.indptr, self.indices, self.last_page_len, self.k_scale, self.v_scale)

    def _scales_require_grad(self) -> bool:
        """Whether an FP8 cache's scales require grad (an nn.Parameter does): the ops have no backward for them
        either. Short-circuits on a cache without scales, as it runs inline on every call; len, not bool, of the
        tuple: torch 2.11's Dynamo traces no bool of a tuple."""
        return len(self._scales) != 0 and (self._scales[0].requires_grad or self._scales[1].requires_grad)

    def _named_tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors an op reads from this cache that could require grad, by the names its errors give them."""
        return {"cache.k_pages": self.k_pages, "cache.v_pages": self.v_pages, "cache.k_scale": self.k_scale,
                "cache.v_scale": self.v_scale}

    def _without_pages(self) -> PagedKVCache:
        """For ``with_pages`` only: this cache's page table, scales and checks holding no pages, so that a caller
        keeping it between layers keeps no layer's pages alive."""
        bare = object.__new__(PagedKVCache)
        bare.__dict__.update(self.__dict__, k_pages=None, v_pages=None,
                             _pages_signature=_pages_signature(self.k_pages, self.v_pages))
        return bare

    def _check_scales(self) -> None:
        # Contiguous, one element or one per head: the kernels read scale h at address + h * (numel > 1).
        k = self.k_pages
        fp8 = k.dtype in SPEC_KV_DTYPES
        for name in ("k_scale", "v_scale"):
            t = getattr(self, name)
            if not fp8:
                if t is not None:
                    raise ValueError(f"{name}: {k.dtype} pages take no scale (only float8_e4m3fn and "
                                     f"float8_e5m2 pages do); got {_describe(t)}")
                continue
            if t is None:
                raise ValueError(f"{name}: {k.dtype} pages need a float32 scale of shape (1,) (per tensor) or "
                                 f"({k.shape[2]},) (per KV head); got None")
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 \
                    or t.numel() not in (1, k.shape[2]):
                raise ValueError(f"{name}: expected a float32 tensor of shape (1,) (per tensor) or ({k.shape[2]},) "
                                 f"(per KV head), got {_describe(t)}")
            if t.device != k.device:
                raise ValueError(f"{name}: on {t.device} while the pages are on {k.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
            if t.device.type == "cpu":
                _check_scale_values(name, t)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def batch(self) -> int:
        return self.indptr.numel() - 1

    def seq_lens(self) -> torch.Tensor:
        """Tokens per sequence, int32 on the cache's device (no synchronization)."""
        pages = (self.indptr[1:] - self.indptr[:-1]).to(torch.int32)
        return torch.where(pages > 0, (pages - 1) * self.page_size + self.last_page_len, 0).to(torch.int32)

    def longest(self) -> int:
        """The longest sequence's tokens, a host int (one synchronization)."""
        return int(self.seq_lens().max()) if self.batch else 0

    def validate(self) -> None:
        """Check the page table's values and the FP8 scales on the device (one synchronization); raise
        naming what is wrong."""
        indptr, indices, last = self.indptr, self.indices, self.last_page_len
        if int(indptr[0]) != 0:
            raise ValueError(f"indptr: must start at 0, starts at {int(indptr[0])}")
        if bool((indptr[1:] < indptr[:-1]).any()):
            raise ValueError("indptr: must be non-decreasing")
        if int(indptr[-1]) > indices.numel():
            raise ValueError(f"indptr: ends at {int(indptr[-1])}, past the {indices.numel()} entries of indices")
        used = indices[: int(indptr[-1])]
        if used.numel() and bool(((used < 0) | (used >= self.num_pages)).any()):
            raise ValueError(f"indices: page indices outside the cache's {self.num_pages} pages")
        has_pages = indptr[1:] > indptr[:-1]
        if bool((has_pages & ((last < 1) | (last > self.page_size))).any()):
            raise ValueError(f"last_page_len: expected 1..{self.page_size} for every sequence with pages")
        for name, t in zip(("k_scale", "v_scale"), self._scales):
            _check_scale_values(name, t)

    @classmethod
    def empty(
        cls, num_pages: int, page_size: int, kv_heads: int, head_dim: int, block_table: torch.Tensor,
        seq_lens: torch.Tensor, *, head_dim_v: int | None = None, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None, k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
    ) -> PagedKVCache:
        """A cache of uninitialized pages with ``from_block_table``'s page table, for ``append_kv`` to fill.

        With ``dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) ``k_scale`` and ``v_scale`` are needed:
        a float (one scale for the tensor) or a float32 tensor of one or ``kv_heads`` elements.
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if page_size not in PAGE_SIZES:  # named as the caller gave it, not as the pages made from it
            raise ValueError(f"page_size: {page_size} is not supported; expected one of {PAGE_SIZES}")
        if not isinstance(block_table, torch.Tensor):
            raise ValueError(f"block_table: expected a [batch, max_pages] tensor, got {_describe(block_table)}")
        device = torch.device(device) if device is not None else block_table.device
        shape = (num_pages, page_size, kv_heads)
        k_pages = torch.empty((*shape, head_dim), dtype=dtype, device=device)
        v_pages = torch.empty((*shape, head_dim if head_dim_v is None else head_dim_v), dtype=dtype, device=device)
        scales = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if isinstance(s, Real) and not isinstance(s, bool):
                try:
                    s = torch.tensor([float(s)], dtype=torch.float32, device=device)
                except OverflowError:  # an int no float holds: as out of range as the inf a float would become
                    raise ValueError(f"{name}: expected finite positive scales, got {s!r}") from None
            scales.append(s)
        return cls.from_block_table(k_pages, v_pages, block_table, seq_lens, k_scale=scales[0], v_scale=scales[1])

    @classmethod
    def from_block_table(
        cls, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> PagedKVCache:
        """The CSR page table of a vLLM-style block table ``[batch, max_pages]`` and lengths ``[batch]``.

        Row ``b`` of the block table lists sequence ``b``'s pages in order; entries past the
        ``ceil(seq_lens[b] / page_size)`` pages it uses are ignored (they may hold anything).
        ``k_scale``/``v_scale``: FP8 pages' scales (see the module docstring).
        """
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table: expected a [batch, max_pages] tensor, got {_describe(block_table)}")
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != block_table.shape[:1]:
            raise ValueError(f"seq_lens: expected a [{block_table.shape[0]}] tensor, got {_describe(seq_lens)}")
        if block_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError("block_table, seq_lens: expected integer tensors")
        if not isinstance(k_pages, torch.Tensor) or k_pages.dim() != 4:
            raise ValueError(f"k_pages: expected a [num_pages, page_size, kv_heads, head_dim] tensor, got "
                             f"{_describe(k_pages)}")
        page_size = k_pages.shape[1]
        if page_size not in PAGE_SIZES:
            raise ValueError(f"k_pages: page size {page_size} is not supported; expected one of {PAGE_SIZES}")
        device = k_pages.device
        lens = seq_lens.to(device=device, dtype=torch.int64)
        pages = (lens + page_size - 1) // page_size
        used = torch.arange(block_table.shape[1], device=device)[None, :] < pages[:, None]
        chosen = block_table.to(device)[used]  # row-major: sequence by sequence, in order
        # Both checks in one synchronization: the entries used must be pages of the cache (before the int32 cast,
        # which would wrap an int64 one into range), as the kernels read them unchecked.
        bad_len, bad_page = torch.stack([((pages > block_table.shape[1]) | (lens < 0)).any(),
                                         ((chosen < 0) | (chosen >= k_pages.shape[0])).any()]).tolist()
        if bad_len:
            raise ValueError(f"seq_lens: a length is negative or needs more than the block table's "
                             f"{block_table.shape[1]} pages of {page_size}")
        if bad_page:
            raise ValueError(f"block_table: a page the sequences use lies outside the {k_pages.shape[0]} pages of "
                             "k_pages")
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=device)
        indptr[1:] = torch.cumsum(pages, 0)
        indices = chosen.to(torch.int32)
        last = torch.where(pages > 0, lens - (pages - 1) * page_size, 0)
        return cls(k_pages, v_pages, indptr.to(torch.int32), indices, last.to(torch.int32), k_scale, v_scale)


def _pages_signature(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What every check and derived value of a cache reads of its pages."""
    return k.shape, v.shape, k.stride(), v.stride(), k.dtype, v.dtype, k.device, v.device


def _check_scale_values(name: str, t: torch.Tensor) -> None:
    """Scales must be finite and positive: a zero, negative, infinite or NaN scale turns every value it
    scales into zero, a flipped sign or NaN. Reads the values (a synchronization for a GPU tensor)."""
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise ValueError(f"{name}: expected finite positive scales, got {t.tolist()}")


def check_heads_q(cache: PagedKVCache, heads_q) -> None:
    """``heads_q``, as a plan over ``cache`` takes it: a positive multiple of the cache's KV heads."""
    if cache.kv_heads == 0:
        raise ValueError(f"cache: no KV head (k_pages of shape {tuple(cache.k_pages.shape)}); expected at least one")
    if isinstance(heads_q, bool) or not isinstance(heads_q, int):
        raise TypeError(f"heads_q: expected a Python int (a positive multiple of the cache's {cache.kv_heads} KV "
                        f"heads), got {heads_q!r} of type {type(heads_q).__qualname__}")
    if heads_q < 1 or heads_q % cache.kv_heads:
        raise ValueError(f"heads_q: expected a positive multiple of the cache's {cache.kv_heads} KV heads, "
                         f"got {heads_q!r}")


def check_run_cache(cache: PagedKVCache, max_seqlen_k: int) -> None:
    """``TILEGEN_DEBUG=1``'s check of the cache a paged plan's ``run`` takes (synchronizes): valid, and no sequence
    grown past the plan's ``max_seqlen_k``, whose chunks would leave its later keys unread."""
    cache.validate()
    longest = cache.longest()
    if longest > max_seqlen_k:
        raise ValueError(f"cache: a sequence of {longest} tokens, past the {max_seqlen_k} the plan covers; plan again "
                         f"on this cache (or with max_seqlen_k >= {longest})")


def check_max_seqlen_k(cache: PagedKVCache, max_seqlen_k: int) -> None:
    """``TILEGEN_DEBUG=1``'s check of a plan's ``max_seqlen_k`` against the cache's longest sequence (one
    synchronization): keys past it may go unread, so a smaller one gives a wrong answer, not an error."""
    longest = cache.longest()
    if longest > max_seqlen_k:
        raise ValueError(f"max_seqlen_k: {max_seqlen_k}, but the cache holds a sequence of {longest} tokens; "
                         f"expected at least {longest}")


def page_dtypes(cache: PagedKVCache, q_dtype: torch.dtype | None) -> tuple[str | None, torch.dtype]:
    """``(kv_dtype, q_dtype)`` of a plan over ``cache``: the FP8 format of its pages (None for 16- and
    32-bit pages), and the query's dtype, which is the pages' unless they are FP8 (then float16,
    bfloat16 or float32; bfloat16 when left out)."""
    pages = cache.k_pages
    kv_dtype = SPEC_KV_DTYPES.get(pages.dtype)
    if pages.dtype not in SPEC_DTYPES and kv_dtype is None:
        raise TypeError(f"cache: expected float16, bfloat16, float32, float8_e4m3fn or float8_e5m2 pages, "
                        f"got {pages.dtype}")
    if q_dtype is None:
        q_dtype = torch.bfloat16 if kv_dtype else pages.dtype
    if (q_dtype not in SPEC_DTYPES) if kv_dtype else (q_dtype != pages.dtype):
        raise ValueError(f"q_dtype: expected {'float16, bfloat16 or float32' if kv_dtype else pages.dtype} "
                         f"for {pages.dtype} pages, got {q_dtype!r}")
    return kv_dtype, q_dtype


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
