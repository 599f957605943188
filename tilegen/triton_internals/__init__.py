"""Everything of tilegen that reads Triton's private internals, behind one gate.

Triton's public surface (``triton.jit``, ``triton.language``, ``triton.testing``,
``triton.tools.tensor_descriptor``, ``triton.experimental.gluon``) is used everywhere; what
Triton does not promise to keep is used only here:

- ``gate``: whether the installed Triton's internals are the ones tilegen was written
  against (recognised by the source of ``JITFunction.run`` and of the members the other
  pieces touch), asked by every piece below before it reads or patches anything;
- ``launch``: launching compiled kernels without ``JITFunction.run``'s per-call work
  (``launch.support()`` says why not, where not);
- ``kernel_index``: finding a compiled kernel again in a new process without the JIT;
- ``warmup``: Triton's one-time per-process work, done in the background;
- ``compile_only``: compile-ahead's processes, which compile kernels without launching them;
- ``interpreter``: fixes to Triton's CPU interpreter that the kernels need, each applied where
  a probe shows its bug (on any Triton, recognised or not).

On a Triton whose internals are not recognised, each piece steps aside: every kernel launches
through the JIT, as plain Triton code would, the index is neither read nor written, the
warm-up does nothing, and compile-ahead starts no process (saying so once in the log).
"""

#: Compile options every launch of a generated kernel passes (``launch``: through the JIT or directly; compile-ahead's
#: processes; the kernel index's records name them), so that no Triton default decides them. FMA contraction on: the
#: shipped rows were tuned with it, Triton 3.9 warns on every launch that leaves it to the default, and Triton 3.10
#: turns that default off (it would change the kernels' speed and rounding).
OPTIONS = {"enable_fp_fusion": True}
