"""A stand-in CUDA driver for checking launches on a machine without a GPU.

Import it first in a process of its own, without TRITON_INTERPRET: kernels then compile for
an H200 (sm90) with Triton's real compiler, and every launch of a compiled kernel is
recorded in ``LAUNCHES`` instead of reaching a GPU (the arguments as the kernel's launcher
receives them, tensors as their data pointer and dtype). ``JIT_RUNS`` counts the launches
that went through ``JITFunction.run``. The ops are let take CPU tensors as under the
interpreter, so whole calls run, with the configs they would use there.

With ``FAKE_CUDA_UNKNOWN_TRITON=1`` tilegen first sees Triton with ``JITFunction.run`` already
wrapped (by the counting wrapper below), a method whose source it does not know: what a
Triton it was not written against looks like to ``tilegen.triton_internals.gate``.
"""

import os

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import compiler
from triton.runtime import jit
from triton.runtime.driver import driver
from triton.tools.tensor_descriptor import TensorDescriptor

LAUNCHES: list[tuple] = []
JIT_RUNS = [0]
#: Each JIT run's ``enable_fp_fusion`` option (None where the launch left it to Triton's default).
JIT_FUSION: list = []
UNKNOWN_TRITON = os.environ.get("FAKE_CUDA_UNKNOWN_TRITON") == "1"

_jit_run = jit.JITFunction.run


def _counting_run(self, *args, **kwargs):
    JIT_RUNS[0] += 1
    JIT_FUSION.append(kwargs.get("enable_fp_fusion"))
    return _jit_run(self, *args, **kwargs)


if UNKNOWN_TRITON:  # before tilegen's import, whose warm-up thread asks the gate at once
    jit.JITFunction.run = _counting_run

from tilegen.triton_internals import gate  # noqa: E402

# Otherwise read before JITFunction.run is wrapped below, as the unwrapped Triton is the one to recognise.
INTERNALS = gate.internals()


class FakeDriver:
    def __init__(self):
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda device: 0x5EED

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value.dtype)
    if isinstance(value, TensorDescriptor):
        return ("descriptor", value.base.data_ptr(), value.base.dtype, tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), value.padding)
    if type(value).__module__ == "triton.experimental.gluon.nvidia.hopper":
        return ("gluon descriptor", value.base.data_ptr(), value.base.dtype, tuple(value.shape),
                tuple(value.strides), tuple(value.block_shape), repr(value.layout), value.padding)
    return (type(value).__name__, value)


def _init_handles(self):
    if self.module is not None:
        return
    # The binary by its cache hash, not the object: two processes (or the JIT and the kernel index)
    # that load one cached kernel load two objects of it.
    self.module, self.function, self.n_regs, self.n_spills = "module", (self.hash, self.name), 0, 0

    def run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        idle = [h is None or (type(h).__name__ == "HookChain" and not h.calls) for h in (enter, exit_)]
        # An idle hook is passed as None by the direct path; the launcher skips both alike.
        hooks = None if all(idle) else (enter, exit_, type(launch_metadata).__name__)
        LAUNCHES.append((self.name, (grid_0, grid_1, grid_2), stream, function, repr(packed_metadata), hooks,
                         tuple(_describe(a) for a in args)))

    self._run = run


compiler.CompiledKernel._init_handles = _init_handles
jit.JITFunction.run = _counting_run
driver.set_active(FakeDriver())

# After the patches: the ops check the device as under the interpreter.
import tilegen.ops.append  # noqa: E402
import tilegen.ops.attention  # noqa: E402
import tilegen.ops.decode  # noqa: E402
import tilegen.ops.tensors  # noqa: E402
import tilegen.ops.varlen  # noqa: E402

for _op in (tilegen.ops.append, tilegen.ops.attention, tilegen.ops.decode, tilegen.ops.tensors, tilegen.ops.varlen):
    _op.interpreting = lambda: True
