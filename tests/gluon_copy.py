"""A small Gluon kernel on Hopper TMA descriptors, for the launch checks on the fake driver
(``direct_launch_check``, ``kernel_index_check``): the generated Gluon kernels run only on CUDA
tensors, which a machine without a GPU has none of, but their launches take the same path.

``KERNEL`` is ``None`` where this Triton has no Gluon Hopper API.
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    gluon = None

KERNEL = None

if gluon is not None:
    # Triton 3.6's names, renamed since.
    _load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.jit
    def gluon_copy(src, dst, scale, n_rows, BLOCK: gl.constexpr):
        """Rows [BLOCK * pid, ...) of ``src`` into ``dst`` through shared memory (``scale`` and ``n_rows``
        are there to be specialized: a float and an int beside the descriptors)."""
        smem = gl.allocate_shared_memory(src.dtype, src.block_type.shape, src.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, src.block_type.nbytes)
        row = gl.program_id(0) * BLOCK
        _load(src, [row, 0], bar, smem)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        _store(dst, [row, 0], smem)
        tma.store_wait(0)

    KERNEL = gluon_copy


def descriptors(rows: int, cols: int = 64, block: int = 16, dtype=torch.bfloat16):
    """A source and a destination descriptor of ``[rows, cols]`` tensors, blocks of ``[block, cols]``."""
    layout = gl.NVMMASharedLayout.get_default_for([block, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
    src, dst = torch.randn(rows, cols, dtype=dtype), torch.empty(rows, cols, dtype=dtype)
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [block, cols], layout) for t in (src, dst))
