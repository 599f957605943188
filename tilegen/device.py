"""GPU identity: what a tuned config is keyed on, and the limits its search space respects."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tilegen import env

__all__ = ["DeviceInfo", "CPU_INTERPRETER", "device_info", "host_gpu_models"]


@dataclass(frozen=True)
class DeviceInfo:
    """Identity and limits of the device kernels run on.

    ``key`` is what tuned rows are filed under; it changes with the GPU model and its
    compute capability, never with the device index.
    """

    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    smem_bytes: int

    @property
    def key(self) -> str:
        return f"{self.name.replace(' ', '_')}-sm{self.capability[0]}{self.capability[1]}"

    @property
    def is_interpreter(self) -> bool:
        return self.name == CPU_INTERPRETER.name


#: Kernels run by Triton's interpreter on the CPU. Rows tuned there are filed under
#: this identity and so never match a GPU.
CPU_INTERPRETER = DeviceInfo("cpu-interpreter", (0, 0), 1, 0, 232448)


@functools.cache
def device_info(index: int | None = None) -> DeviceInfo:
    if env.interpreting() or not torch.cuda.is_available():
        return CPU_INTERPRETER
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 49152
    return DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count, props.total_memory, smem)


def host_gpu_models() -> set[str] | None:
    """The model names of every GPU of this host, from NVML: no CUDA context, which on a host of
    several GPUs takes a second or more to start. ``None`` where NVML cannot tell."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        models = set()
        for index in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetName(handle, name, len(name)) != 0:
                return None
            models.add(name.value.decode(errors="replace"))
        return models
    finally:
        nvml.nvmlShutdown()
