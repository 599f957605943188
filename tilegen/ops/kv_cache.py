"""``tilegen.PagedKVCache``: keys and values in fixed-size pages, found through a page table.

Layout (FlashInfer's "NHD" paged layout):

- ``k_pages``, ``v_pages``: ``[num_pages, page_size, kv_heads, head_dim]`` (``head_dim_v`` for
  V), one dtype and device; a page holds ``page_size`` consecutive tokens of one sequence.
- the page table, in CSR form over the batch: sequence ``b`` owns pages
  ``indices[indptr[b]:indptr[b + 1]]`` in token order, and its last page holds
  ``last_page_len[b]`` tokens (``1..page_size``; a sequence with no page has length 0 and its
  ``last_page_len`` is ignored). All three are int32 on the pages' device.

So token ``t`` of sequence ``b`` lives at page ``indices[indptr[b] + t // page_size]``, slot
``t % page_size``, and sequence ``b`` holds
``(indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b]`` tokens.

Checks. Building a cache checks shapes, dtypes, devices, contiguity and the page size on the
host, on every construction (cheap). The page table's values (monotone ``indptr``, indices
inside the cache, ``last_page_len`` in range) live on the device; ``validate()`` checks them
there at the cost of one synchronization, and ``TILEGEN_DEBUG=1`` makes every construction call
it. Without it the kernels clamp what they read into the tensors (``indptr`` into ``indices``,
page ids into the pages, ``last_page_len`` into ``1..page_size``): a wrong value gives a wrong
answer for its sequence, never an access outside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilegen import env

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
        # What a decode plan fixes, read once here: a run per layer compares this tuple instead of
        # building it from four tensors' shapes (half a microsecond of a short call's host time).
        object.__setattr__(self, "_layout", (k.shape[1], k.shape[2], k.shape[3], v.shape[3],
                                             self.indptr.shape[0], k.dtype))
        if env.debug():
            self.validate()

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

    def validate(self) -> None:
        """Check the page table's values on the device (one synchronization); raise naming what is wrong."""
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

    @classmethod
    def from_block_table(
        cls, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> PagedKVCache:
        """The CSR page table of a vLLM-style block table ``[batch, max_pages]`` and lengths ``[batch]``.

        Row ``b`` of the block table lists sequence ``b``'s pages in order; entries past the
        ``ceil(seq_lens[b] / page_size)`` pages it uses are ignored (they may hold anything).
        """
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table: expected a [batch, max_pages] tensor, got {_describe(block_table)}")
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != block_table.shape[:1]:
            raise ValueError(f"seq_lens: expected a [{block_table.shape[0]}] tensor, got {_describe(seq_lens)}")
        if block_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError("block_table, seq_lens: expected integer tensors")
        page_size = k_pages.shape[1] if isinstance(k_pages, torch.Tensor) and k_pages.dim() == 4 else 0
        if page_size not in PAGE_SIZES:
            raise ValueError(f"k_pages: page size {page_size} is not supported; expected one of {PAGE_SIZES}")
        device = k_pages.device
        lens = seq_lens.to(device=device, dtype=torch.int64)
        pages = (lens + page_size - 1) // page_size
        if bool((pages > block_table.shape[1]).any()) or bool((lens < 0).any()):
            raise ValueError(f"seq_lens: a length is negative or needs more than the block table's "
                             f"{block_table.shape[1]} pages of {page_size}")
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=device)
        indptr[1:] = torch.cumsum(pages, 0)
        used = torch.arange(block_table.shape[1], device=device)[None, :] < pages[:, None]
        indices = block_table.to(device)[used].to(torch.int32)  # row-major: sequence by sequence, in order
        last = torch.where(pages > 0, lens - (pages - 1) * page_size, 0)
        return cls(k_pages, v_pages, indptr.to(torch.int32), indices, last.to(torch.int32))


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
