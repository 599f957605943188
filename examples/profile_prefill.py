"""Two launches each of tilegen's prefill kernel and SDPA cuDNN's, on two shapes, for a profiler.

    ncu --target-processes all -k 'regex:attention_fwd|sdpa|fprop' --launch-count 8 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \\
        --csv --page details python examples/profile_prefill.py

bf16, 32 heads of dim 128: 16 x 1024 with no mask (tilegen's weakest shape against cuDNN) and
1 x 16384 causal. The first launch of each compiles; run the script once without the profiler
first so that compile time stays out of the profiled process. Each shape's config is printed.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tilegen

SHAPES = ((16, 1024, 128, False), (1, 16384, 128, True))


def main() -> None:
    if not torch.cuda.is_available():
        # Profiling is of GPU kernels, and these shapes would take hours under the interpreter.
        sys.exit("error: profile_prefill.py profiles GPU kernels and this machine has no CUDA GPU; "
                 "examples/compare_sdpa.py runs on a CPU")
    for batch, n, d, causal in SHAPES:
        q, k, v = (torch.randn(batch, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        print(batch, n, d, "causal" if causal else "full", tilegen.explain(q, k, v, causal=causal).config, flush=True)
        for _ in range(2):
            tilegen.attention(q, k, v, causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(2):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
