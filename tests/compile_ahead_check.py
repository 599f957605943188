"""Compile ahead, with kernels compiled for sm90 and no GPU (``fake_cuda``).

    python tests/compile_ahead_check.py ahead|launch [processes]

Run without TRITON_INTERPRET, against one TRITON_CACHE_DIR (``tests/test_compile_ahead.py``
does). ``ahead`` compiles the cases' configs in a ``CompileAhead`` pool (its processes are forked
copies of this one, fake driver included) and prints one JSON line of the pool's
reports; ``launch`` (a new process) launches them as the tuning worker does, through the
family Problem's launch, and prints one JSON line: how many kernels Triton had to build (its
``make_ir``, which a cache hit skips), the errors, and the launches recorded.
"""

from __future__ import annotations

import fake_cuda  # noqa: F401  first: the fake driver, in this process and in the pool's
import json
import sys
import time

import torch
from fake_cuda import LAUNCHES
from triton.compiler import compiler

from tilegen.device import DeviceInfo
from tilegen.families import family_of
from tilegen.families.attention_decode.spec import DecodeSpec
from tilegen.families.attention_fwd import AttentionSpec

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
#: num_warps=3 is no power of two: Triton refuses it before compiling anything.
BROKEN = {"num_warps": 3}


def cases():
    """(family, problem, configs): two sm90 configs of two families, and one that cannot compile."""
    out = []
    for spec, bucket in ((AttentionSpec(head_dim=64, dtype="bf16", mask="causal"), 128),
                         (DecodeSpec(head_dim=64, q_per_kv=4, dtype="bf16", page_size=16), family_of(DecodeSpec(head_dim=64, q_per_kv=4, dtype="bf16", page_size=16)).buckets.pack(256, 4))):
        family = family_of(spec)
        # Pointer configs: below the launcher's size floor for descriptors a tma=1 config builds the same kernel.
        configs = [c for c in family.candidates(spec, H200) if not getattr(c, "tma", 0)][:2]
        broken = family.config_type.from_dict({**configs[0].to_dict(), **BROKEN})
        out.append((family, family.problem(spec, bucket, on_gpu=False), [*configs, broken]))
    return out


def ahead(processes: int) -> None:
    from tilegen.tuning.compile_ahead import CompileAhead

    reports, waited = [], []
    start = time.perf_counter()
    with CompileAhead(processes) as pool:
        pool.start(fork=True)  # as a tune starts them: copies of this process, which has not loaded CUDA
        started = sorted({proc._popen.method for proc in pool._procs})
        for family, problem, configs in cases():
            pool.bucket(family, problem, configs)
            # With 2 processes the first two configs start at once; the third waits its turn.
            waited.append([pool.wait(configs[0], timeout=300), pool.wait(configs[2], timeout=300)])
            reports += pool.reports(wait_for=len(configs), timeout=300)
            pool.end_bucket()
    print(json.dumps({"reports": reports, "waited": waited, "started": started,
                      "seconds": time.perf_counter() - start}), flush=True)


def launch() -> None:
    from tilegen.dispatch import launcher_for

    built = [0]
    make_ir = compiler.ASTSource.make_ir

    def counting(self, *args, **kwargs):
        built[0] += 1
        return make_ir(self, *args, **kwargs)

    compiler.ASTSource.make_ir = counting
    errors, launches = [], []
    start = time.perf_counter()
    for family, problem, configs in cases():
        module = launcher_for(problem.spec)  # what the worker measures through (tilegen.tuning.measure)
        inputs = problem.inputs(7)
        outputs = problem.outputs(inputs)
        for config in configs:
            del LAUNCHES[:]
            try:
                problem.launch(module, config, inputs, outputs)
            except Exception as e:
                errors.append([config.to_json(), type(e).__name__])
            # Pointers differ from run to run; what Triton specializes on is their 16-byte alignment.
            launches.append(repr([(*launch[:-1], tuple((kind, v % 16, str(d)) if kind == "tensor" else (kind, v)
                                                       for kind, v, *d in launch[-1]))
                                  for launch in LAUNCHES]))
    print(json.dumps({"built": built[0], "errors": errors, "launches": launches,
                      "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1] == "ahead":
        ahead(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    else:
        launch()
