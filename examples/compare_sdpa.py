"""Run tilegen.attention and compare it with PyTorch's scaled_dot_product_attention.

    python examples/compare_sdpa.py            # CUDA if present, else Triton's CPU interpreter

On a CPU the kernels run under TRITON_INTERPRET=1 on small shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

import tilegen  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
# The causal call matches `tilegen tune`'s default preset (d=64, causal, bf16), so after a
# tune it runs the tuned config; GQA works the same way with fewer KV heads.
batch, heads_q, heads_kv, seqlen, head_dim = (4, 32, 32, 2048, 64) if device == "cuda" else (1, 2, 2, 97, 64)
torch.manual_seed(0)
q = torch.randn(batch, heads_q, seqlen, head_dim, device=device, dtype=torch.bfloat16)
k = torch.randn(batch, heads_kv, seqlen, head_dim, device=device, dtype=torch.bfloat16)
v = torch.randn(batch, heads_kv, seqlen, head_dim, device=device, dtype=torch.bfloat16)

for causal in (False, True):
    out = tilegen.attention(q, k, v, causal=causal)
    # SDPA's reference in fp32, so the comparison measures tilegen's error, not SDPA's.
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    choice = tilegen.explain(q, k, v, causal=causal)
    print(f"causal={causal!s:5} relative error vs SDPA (fp32): {rel:.2e}  config {choice.config} ({choice.source})")
    assert rel < 1e-2 and torch.isfinite(out).all()
