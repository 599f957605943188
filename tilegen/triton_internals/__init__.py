"""Everything of tilegen that reads Triton's private internals, behind one gate.

Triton's public surface (``triton.jit``, ``triton.language``, ``triton.testing``) is used
everywhere; what Triton does not promise to keep is used only here:

- ``launch``: launching compiled kernels without ``JITFunction.run``'s per-call work, on the
  Triton versions whose launch path it recognises (``launch.support()`` says why not elsewhere);
- ``kernel_index``: finding a compiled kernel again in a new process without the JIT;
- ``warmup``: Triton's one-time per-process work, done in the background;
- ``interpreter``: fixes to Triton's CPU interpreter that the kernels need.

On a Triton whose internals are not recognised, each piece steps aside and every kernel
launches through the JIT, as plain Triton code would.
"""
