"""Compile a generated kernel for an H200 (sm90) ahead of time, with no GPU: the Triton compiler
rejects what its CPU interpreter lets through (types, block shapes, constexpr rules).

    python tests/sm90_compile.py '{"spec": {...}, "pointers": {"K": "*bf16", ...}, "configs": [...]}'

Run in a process of its own without TRITON_INTERPRET, so that ``@triton.jit`` makes compilable
functions. Each config holds the kernel's constexpr arguments and ``num_warps``; every other
argument is an i32. ``"kernel"`` names another kernel of the module by its suffix (default
``"kernel"``, e.g. ``"kernel_merge"``) or, starting with ``_``, by its own name (``"_dkdv"``), and
a config's ``launch_pdl`` and ``num_stages`` are passed as those options. Prints one line per
compiled config, with its cubin's size and the shared memory it needs; with ``"ptxas": true`` the
line also gives the bytes of spill stores ptxas reports and says whether it serialized the kernel's
wgmma instructions (its C7514 warning), assembling the PTX once more.
"""

import json
import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tilegen.codegen import source_for  # noqa: E402
from tilegen.families import spec_from_json  # noqa: E402


def main(request: dict) -> None:
    spec = spec_from_json(request["spec"])
    module = types.ModuleType(spec.name)
    path = os.path.join(os.environ["TILEGEN_CACHE_DIR"], f"sm90_{spec.hash}.py")  # jit reads its source file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(source_for(spec))
    module.__file__ = path
    sys.modules[spec.name] = module
    exec(compile(open(path).read(), path, "exec"), module.__dict__)
    name = request.get("kernel", "kernel")
    kernel = getattr(module, name if name.startswith("_") else f"_{spec.name}_{name}")
    for config in request["configs"]:
        config = dict(config)
        warps = config.pop("num_warps")
        options = {"num_warps": warps, **({"launch_pdl": config.pop("launch_pdl")} if "launch_pdl" in config else {}),
                   **({"num_stages": config.pop("num_stages")} if "num_stages" in config else {})}
        signature = {
            name: "constexpr" if name in config else request["pointers"].get(name, "i32") for name in kernel.arg_names
        }
        source = ASTSource
        if getattr(kernel, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source

            if "num_warps" in kernel.arg_names:  # a Gluon kernel reads its warp count as a constexpr too
                signature["num_warps"] = "constexpr"
                config["num_warps"] = warps
        compiled = triton.compile(source(kernel, signature, constexprs=config), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        line = [spec.name, config, warps, "cubin bytes", len(compiled.asm["cubin"]), "shared bytes",
                compiled.metadata.shared]
        if request.get("ptxas"):
            serialized, spilled = _ptxas(compiled.asm["ptx"])
            line += ["spill stores bytes", spilled, "wgmma serialized" if serialized else "wgmma async"]
        print(*line)


def _ptxas(ptx: str) -> tuple[bool, int]:
    """Whether ptxas serialized the wgmma instructions, and the bytes of spill stores it reports."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    return "C7514" in report, sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
