"""Gradients through score and mask mods (tilegen.mods.grad and the attention_bwd family with mods).

Every gradient, to Q, K, V and to captured tensors that require grad, is held against torch autograd of the
float64 reference (``attention_reference``/``varlen_reference`` applying the same functions to the whole
score matrix), with a random LSE gradient too: max abs error relative to the reference's max abs, below
1e-4 in fp32 and 1e-2 in bf16/fp16. Shapes are off every block size (1, 17, 33) and small: the
interpreter is slow, and the suite runs three times in CI.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import compile_for_sm90

import tilegen
from tilegen.codegen import module_for, source_for
from tilegen.families.attention_bwd import AttentionBwdSpec
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_varlen.reference import varlen_reference
from tilegen.mods import library
from tilegen.mods.blocks import block_table
from tilegen.mods.grad import ModGradError
from tilegen.mods.trace import trace

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
D = 16


def _error(got, ref) -> float:
    assert got is not None and got.shape == ref.shape
    assert not torch.isnan(got).any(), f"{torch.isnan(got).sum().item()} NaN gradient elements"
    scale = ref.abs().max().item()
    return (got.double() - ref.double()).abs().max().item() / scale if scale else got.abs().max().item()


def _leaves(shapes, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]


def _cotangents(out, lse, seed):
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    # Rows that see no key have an LSE of -inf, which drops out of the loss.
    dlse = torch.randn(lse.shape, generator=gen).to(lse.device) * torch.isfinite(lse.detach())
    return dout, dlse


def _loss(out, lse, dout, dlse):
    return (out.double() * dout.double()).sum() + (torch.where(dlse != 0, lse, 0).double() * dlse).sum()


def _grads(run, leaves, captured, seed):
    """Gradients of the loss of ``run()`` -> (out, lse) to ``leaves`` and ``captured``, and the cotangents."""
    out, lse = run()
    dout, dlse = _cotangents(out, lse, seed)
    return torch.autograd.grad(_loss(out, lse, dout, dlse), [*leaves, *captured]), dout, dlse


def _check_dense(score_mod, mask_mod, captured, batch, hq, hkv, n_q, n_k, dtype, device, **kwargs):
    q, k, v = _leaves([(batch, hq, n_q, D), (batch, hkv, n_k, D), (batch, hkv, n_k, D)], dtype, device, n_q + n_k)
    got, dout, dlse = _grads(lambda: tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                        return_lse=True, **kwargs), [q, k, v], captured, 7)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves64, score_mod=score_mod, mask_mod=mask_mod, **kwargs)
    ref = torch.autograd.grad(_loss(out, lse, dout, dlse), [*leaves64, *captured])
    for name, g, r in zip(["dq", "dk", "dv", *(f"captured {i}" for i in range(len(captured)))], got, ref):
        assert g.dtype == (dtype if name.startswith("d") else r.dtype)
        error = _error(g, r)
        assert error < TOL[dtype], f"{name}: relative error {error:.2e}"
    return got


def _cases(device):
    g = torch.Generator().manual_seed(1)
    slopes = torch.rand(4, generator=g).to(device).requires_grad_()
    table = torch.randn(4, 8, generator=g).to(device).requires_grad_()
    slopes2 = torch.rand(2, generator=g).to(device).requires_grad_()
    table2 = torch.randn(2, 8, generator=g).to(device).requires_grad_()
    docs = torch.tensor([0] * 5 + [1] * 20 + [2] * 8, device=device)
    # (id, score_mod, mask_mod, captured tensors that take a gradient, batch, heads_q, heads_kv, n_q, n_k, dtype,
    # kwargs)
    return [
        ("alibi-learned-gqa-fp32", library.alibi(slopes), None, [slopes], 1, 4, 2, 17, 33, torch.float32, {}),
        ("relative-bias-learned-document-fp32", library.relative_bias(table, 8, 16), library.document_mask(docs),
         [table], 1, 4, 1, 33, 33, torch.float32, {}),
        ("alibi-learned-causal-bf16", library.alibi(slopes2), None, [slopes2], 2, 2, 1, 33, 17,
         torch.bfloat16, {"causal": True}),
        # Buckets that end at distance 3: blocks far from the diagonal read one bias, and its gradient sums there.
        ("relative-bias-learned-far-blocks-fp32", library.relative_bias(table2, 8, 3), None, [table2], 1, 2, 1, 70, 70,
         torch.float32, {}),
        ("prefix-lm-one-query-fp16", None, library.prefix_lm(torch.tensor([5, 0], dtype=torch.int32, device=device)),
         [], 2, 2, 2, 1, 33, torch.float16, {}),
        ("sliding-global-causal-fp32", None, library.sliding_window(4, global_tokens=2), [], 1, 2, 1, 33, 17,
         torch.float32, {"causal": True}),
        ("alibi-document-window-fp32", library.alibi(slopes2), library.document_mask(docs), [slopes2], 1, 2, 1, 33,
         33, torch.float32, {"window": (6, 2)}),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _cases("cpu")])
def test_library_mod_gradients_match_the_reference(name, device):
    case = next(c for c in _cases(device) if c[0] == name)
    _, score_mod, mask_mod, captured, batch, hq, hkv, n_q, n_k, dtype, kwargs = case
    _check_dense(score_mod, mask_mod, captured, batch, hq, hkv, n_q, n_k, dtype, device, **kwargs)


def test_every_differentiable_operation(device):
    """One score mod over every operation whose derivative is formed (casts, abs, min/max ties, clamp, where,
    integer // and % beside them), with learned fp32 tensors and an fp16 table that takes no gradient. A cast to
    bf16 of a value the score reaches is left out: torch rounds its gradient to bf16 there, the kernel's tangents
    stay fp32."""
    scale = torch.tensor([0.5, 1.5, -2.0], device=device).requires_grad_()
    bias = torch.randn(2, 17, device=device).requires_grad_()
    table = torch.randn(3, 4, device=device).half()

    def score_mod(score, b, h, q_idx, kv_idx):
        x = torch.sqrt(torch.abs(score) + 1.0) - torch.exp(-torch.abs(score)) + torch.log(kv_idx.to(torch.float32) + 2)
        x = torch.minimum(x, torch.maximum(score, -score / 2)) + torch.clamp(score, -0.5, 0.25) / (1.5 + scale[h])
        x = torch.tanh(x * scale[h % 3]).float() * 3 + table[h % 3, (q_idx - kv_idx) // -5 % 4]
        x = x + bias[0, q_idx] * scale[h]  # gathers by one position and by neither: a sum per block for the latter
        return torch.where((h == 1) & (q_idx > kv_idx), -x, x + (q_idx % -3)) + torch.maximum(score * 0, score * 0)

    _check_dense(score_mod, None, [scale, bias], 1, 2, 1, 17, 33, torch.float32, device)


@pytest.mark.parametrize("side", ["upper", "lower"])
def test_a_learned_table_read_through_a_one_sided_clamp_takes_its_gradient(side, device):
    """One bound, with the head or a number beside the clamped offset in the index, on blocks far enough from the
    diagonal that the clamp holds them at the bound: such a block adds its sum into one element."""
    table = torch.randn(2, 80, generator=torch.Generator().manual_seed(8)).to(device).requires_grad_()

    def upper(score, b, h, q_idx, kv_idx):  # q_idx - kv_idx from -69 on: the index from 1 to 77
        return score + table[h, torch.clamp(q_idx - kv_idx, max=7) + 70]

    def lower(score, b, h, q_idx, kv_idx):
        return score + table[1, torch.clamp(q_idx - kv_idx, min=-7) + 7] * (h + 1)

    _check_dense({"upper": upper, "lower": lower}[side], None, [table], 1, 2, 1, 70, 70, torch.float32, device)


def test_softcap_as_a_mod_has_the_builtin_softcap_gradients(device):
    q, k, v = _leaves([(1, 2, 17, D), (1, 1, 33, D), (1, 1, 33, D)], torch.float32, device, 3)
    builtin, dout, dlse = _grads(lambda: tilegen.attention(q, k, v, softcap=2.0, scale=1.5, return_lse=True),
                                 [q, k, v], [], 9)
    as_mod, _, _ = _grads(lambda: tilegen.attention(q, k, v, score_mod=library.softcap(2.0), scale=1.5,
                                                    return_lse=True), [q, k, v], [], 9)
    for a, b in zip(as_mod, builtin):
        assert _error(a, b.double()) < TOL[torch.float32]
    _check_dense(library.softcap(2.0), None, [], 1, 2, 1, 17, 33, torch.float32, device, scale=1.5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_gradients_per_sequence(deterministic, device):
    """A ragged batch with an empty and a one-token sequence: ALiBi slopes and a prefix-LM mask; the slopes learned,
    or frozen with the config without atomics (deterministic=True, which a learned captured tensor is refused: its
    gradient is a sum of atomic adds)."""
    lengths, k_lens = [17, 0, 1, 33], [17, 0, 8, 33]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lengths, k_lens))
    q, k, v = _leaves([(sum(lengths), 4, D), (sum(k_lens), 2, D), (sum(k_lens), 2, D)], torch.float32, device, 4)
    slopes = torch.rand(4, device=device).requires_grad_()
    score_mod = library.alibi(slopes)
    mask_mod = library.prefix_lm(torch.tensor([3, 0, 6, 40], dtype=torch.int32, device=device))

    def run():
        return tilegen.varlen_attention(q, k, v, cu_q, cu_k, 33, 33, score_mod=score_mod, mask_mod=mask_mod,
                                        return_lse=True, deterministic=deterministic)

    if deterministic:
        with pytest.raises(NotImplementedError, match="deterministic: the gradients of a score mod's captured"):
            run()
        slopes.requires_grad_(False)
    learned = [] if deterministic else [slopes]
    got, dout, dlse = _grads(run, [q, k, v], learned, 5)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    cu = cu_k.tolist()
    out, lse = varlen_reference(leaves64[0], [leaves64[1][a:b] for a, b in zip(cu, cu[1:])],
                                [leaves64[2][a:b] for a, b in zip(cu, cu[1:])], cu_q.cpu(), score_mod=score_mod,
                                mask_mod=mask_mod)
    ref = torch.autograd.grad(_loss(out, lse, dout, dlse), [*leaves64, *learned])
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), got, ref):
        assert _error(g, r) < TOL[torch.float32], name


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_use_deterministic_algorithms_with_mods(api, compiled, device, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) a call with mods runs the backward without atomics, as a call
    without mods does; a learned captured tensor, whose gradient only atomics sum, is refused there as torch
    refuses its own nondeterministic ops (a warning under warn_only, and the backward with atomics)."""
    import tilegen.ops.attention_grad as grad_module
    from tilegen.mods import compiled as mods_compiled

    if compiled and not mods_compiled.compiles_mods():
        pytest.skip(f"compiled calls with mods need torch {mods_compiled.MIN_TORCH}")
    ran = []
    real = grad_module.deterministic_config
    monkeypatch.setattr(grad_module, "deterministic_config", lambda *args: ran.append(real(*args)) or ran[-1])
    n, cu = 17, torch.tensor([0, 17], dtype=torch.int32, device=device)
    q, k, v = _leaves([(1, 2, n, D), (1, 1, n, D), (1, 1, n, D)], torch.float32, device, 11)
    slopes = torch.rand(2, device=device)
    if api == "varlen":
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))

    def loss(q, k, v, mod):
        if api == "dense":
            return tilegen.attention(q, k, v, causal=True, score_mod=mod).square().sum()
        return tilegen.varlen_attention(q, k, v, cu, cu, n, n, causal=True, score_mod=mod).square().sum()

    torch._dynamo.reset()
    call = torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled else loss
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        call(q, k, v, library.alibi(slopes)).backward()
        assert not ran
        torch.use_deterministic_algorithms(True)
        call(q, k, v, library.alibi(slopes)).backward()
        assert len(ran) == 1 and ran[0].atomic_dq == 0
        learned = slopes.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="use_deterministic_algorithms.*requires_grad=False"):
            call(q, k, v, library.alibi(learned)).backward()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="captured tensors.*runs with atomics"):
            call(q, k, v, library.alibi(learned)).backward()
        assert len(ran) == 1 and learned.grad is not None and torch.isfinite(learned.grad).all()
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@pytest.mark.parametrize("rank", [3, 4])
def test_a_captured_tensor_of_three_or_four_dims_takes_its_gradient_at_each_element(rank, device):
    """The gradient's flat offset nests each dimension in the one before it (((i0 n1 + i1) n2 + i2) n3 + i3): every
    index varies, so an element added at another's offset fails."""
    gen = torch.Generator().manual_seed(rank)
    if rank == 3:
        bias = torch.randn(2, 3, 9, generator=gen).to(device).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, kv_idx]
    else:
        bias = torch.randn(2, 3, 5, 9, generator=gen).to(device).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx]
    _check_dense(score_mod, None, [bias], 2, 3, 1, 5, 9, torch.float32, device)


def test_a_gather_at_an_index_computed_from_the_score_takes_its_gradient_per_score(device):
    """An index that follows the score (a bucket by the logit's sign) follows neither position, yet reads an element
    per score: each score's gradient goes to its own element, not a block's sum to the first score's."""
    table = torch.tensor([0.5, -0.5], device=device).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[(score > 0).int()]

    _check_dense(score_mod, None, [table], 1, 2, 1, 17, 33, torch.float32, device)


def test_an_element_of_a_learned_tensor_at_constant_indices_takes_its_gradient(device):
    """temperature[1] and table[1, 2] (0-dim views, which Python makes before the tracer sees them) are the captured
    tensors read there: their gradients are the sums over every score at those elements."""
    temperature = torch.tensor([0.5, 2.0], device=device).requires_grad_()
    table = torch.randn(2, 3, device=device).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temperature[1] + table[1, 2] * (kv_idx - q_idx) * 0.1

    _check_dense(score_mod, None, [temperature, table], 1, 2, 1, 17, 33, torch.float32, device)


def test_a_captured_tensor_alone_takes_a_gradient(device):
    """Q, K and V frozen, the bias table learned: the call still differentiates, to the table only."""
    table = torch.randn(2, 8, device=device).requires_grad_()
    q, k, v = (torch.randn(1, 2, 17, D, device=device) for _ in range(3))
    tilegen.attention(q, k, v, score_mod=library.relative_bias(table, 8, 16)).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0 and q.grad is None


def test_a_derivative_that_is_a_number_is_not_guarded():
    """dS times a number (ALiBi's and a relative bias's 1.0, a scaling's factor) needs no select over the block, which
    costs the Gluon backward's consumers registers; a derivative that may be infinite where no gradient arrives (log
    at 0, a captured factor) keeps its guard."""
    from tilegen.mods.grad import lower_score_mod_grad

    def returned(fn):
        return lower_score_mod_grad(trace(fn, "score_mod").canonical)[1][-1]

    slopes = torch.rand(2)
    for fn in (library.alibi(slopes), lambda score, b, h, q_idx, kv_idx: score * 2.0 - (kv_idx - q_idx) * 0.5):
        assert returned(fn).startswith("return ds * d_"), returned(fn)
    for fn in (library.softcap(30.0), lambda score, b, h, q_idx, kv_idx: torch.log(torch.abs(score)),
               lambda score, b, h, q_idx, kv_idx: score * slopes[h]):
        assert returned(fn).startswith("return tl.where(ds != 0, ds * d_"), returned(fn)


def test_a_mod_without_a_derivative_is_refused_before_any_kernel_runs(device, monkeypatch):
    def stepped(score, b, h, q_idx, kv_idx):
        return score + (score * 2) // 1

    q, k, v = (torch.randn(1, 2, 17, D, device=device) for _ in range(3))
    tilegen.attention(q, k, v, score_mod=stepped)  # forward only: fine
    from tilegen.ops import attention as op

    monkeypatch.setattr(op, "launcher_for", lambda spec: pytest.fail("a kernel was launched"))
    with pytest.raises(ModGradError, match=r"score_mod: the derivative of floordiv \(v1 = floordiv\(v0, 1\)\)"):
        tilegen.attention(q.requires_grad_(), k, v, score_mod=stepped)


def test_a_direct_launch_writes_every_gradient(device):
    """The backward module with mods launched into NaN-poisoned dQ, dK, dV (an element never written stays NaN)."""
    table = torch.randn(2, 8, device=device)
    score_mod = library.relative_bias(table, 8, 16)
    mask_mod = library.document_mask(torch.tensor([0] * 4 + [1] * 29, device=device))
    sm, mm = trace(score_mod, "score_mod"), trace(mask_mod, "mask_mod")
    spec = AttentionBwdSpec(head_dim=D, q_per_kv=2, dtype="fp32", score_mod=sm.canonical, mask_mod=mm.canonical)
    q, k, v = (torch.randn(1, h, 33, D, device=device) for h in (2, 1, 1))
    out, lse = tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    dout = torch.randn_like(out)
    for atomic_dq in (0, 1):
        dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
        delta, lse2 = torch.full_like(lse, math.nan), torch.full_like(lse, math.nan)
        acc = torch.full(q.shape, math.nan, device=device)
        grad = torch.zeros(table.shape, device=device)
        block = 32 if atomic_dq else 16
        tables = (block_table(mm.canonical, mm.tensors, 1, 2, 33, 33, 16, 32, device, True),
                  None if atomic_dq else block_table(mm.canonical, mm.tensors, 1, 2, 33, 33, block, block, device))
        module_for(spec).launch(q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2, acc, None, None, 33, 33,
                                scale=D ** -0.5, softcap=0.0, window_left=66, window_right=66,
                                block_m1=16, block_n1=32, num_warps1=4, num_stages1=1, block_m2=block, block_n2=block,
                                num_warps2=4, num_stages2=1, atomic_dq=atomic_dq,
                                mod_tensors=(*sm.tensors, *mm.tensors),
                                mod_grads=[grad], mod_blocks_dkdv=tables[0], mod_blocks_dq=tables[1])
        assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
        assert grad.abs().sum() > 0


def test_a_backward_spec_without_mods_keeps_its_hash_and_module():
    spec = AttentionBwdSpec(head_dim=64, mask="causal", dtype="bf16")
    assert "mod" not in spec.to_json()
    assert "_score_mod" not in source_for(spec) and "_mask_mod" not in source_for(spec)


def test_the_dkdv_kernel_walks_a_transposed_block_table(device):
    """Per key block, the query blocks the mask mod does not empty (the forward's table transposed); with none
    listed, dK and dV get nothing."""
    from tilegen.mods.blocks import _tables

    # Documents longer than a GPU's tiles (up to 128), so some block pairs are empty there too.
    lengths = (5, 20, 8) if device == "cpu" else (150, 300, 150)
    n = sum(lengths)
    mask_mod = library.document_mask(torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).to(device))
    q, k, v = _leaves([(1, 2, n, D), (1, 1, n, D), (1, 1, n, D)], torch.float32, device, 8)
    tilegen.attention(q, k, v, mask_mod=mask_mod).sum().backward()
    table = next(t for _, t in reversed(_tables.values()) if t.transposed)
    mm = trace(mask_mod, "mask_mod")
    forward = block_table(mm.canonical, mm.tensors, 1, 2, n, n, table.block_m, table.block_n, device)
    listed = {(qb, kb) for qb, n in enumerate(forward.count.tolist()) for kb in forward.indices[qb, :n].tolist()}
    listed_t = {(qb, kb) for kb, n in enumerate(table.count.tolist()) for qb in table.indices[kb, :n].tolist()}
    assert listed == listed_t and len(listed) < forward.count.shape[0] * forward.indices.shape[1]
    table.run_count.zero_()
    q.grad = k.grad = v.grad = None
    tilegen.attention(q, k, v, mask_mod=mask_mod).sum().backward()
    assert (k.grad == 0).all() and (v.grad == 0).all() and (q.grad != 0).any()


def test_the_dkdv_kernel_with_mods_compiles_for_an_h200(tmp_path):
    """What the interpreter runs, the sm90 compiler must accept: the dK/dV kernel with a learned bias gathered by
    both positions (its atomics), an int64 document mask and the transposed block table (the dQ kernel calls the
    same functions, without the atomics; test_mods compiles every operation in the forward)."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    score_mod = trace(library.relative_bias(torch.randn(4, 8), 8, 16), "score_mod").canonical
    mask_mod = trace(library.document_mask(torch.zeros(64, dtype=torch.int64)), "mask_mod").canonical
    spec = AttentionBwdSpec(head_dim=64, q_per_kv=2, mask="causal", dtype="bf16", score_mod=score_mod,
                            mask_mod=mask_mod)
    # The bias's captured tensors: its bucket table (int32), then the learned table (its gradient sm_t1_g).
    pointers = {"sm_t0": "*i32", "sm_t1": "*fp32", "sm_t1_g": "*fp32", "mm_t0": "*i64", "RUN_COUNT": "*i32",
                "RUN_START": "*i32", "RUN_END": "*i32", "RUN_FULL": "*i8",
                **dict.fromkeys(("Q", "K", "V", "dOut", "dK", "dV"), "*bf16"),
                **dict.fromkeys(("DqAcc", "Delta", "Lse2"), "*fp32"),
                **dict.fromkeys(("qk_scale", "softcap_scale", "sm_scale"), "fp32")}
    # Small tiles: a cold compile of 64x64 ones took 25-45 s, of these about 10 s (what a kernel without mods takes).
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "ATOMIC_DQ": True, "TMA": False, "SM_T1_G": True, "num_warps": 4}
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": [config], "kernel": "_dkdv"}
    compile_for_sm90(request, tmp_path, kernels=1)



def test_a_gather_by_both_positions_takes_backward_tiles_that_fit_an_h200():
    """T5's relative bias stages a score tile of gathers through shared memory: the default takes tiles whose count
    fits the H200's 227 KiB, and the mod-free default (M64-N128-s3 for dK/dV, which asked 290 KiB) is refused."""
    from tilegen.device import DeviceInfo
    from tilegen.families.attention_bwd.config import Config, default_rule, feasible

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
    bias = trace(library.relative_bias(torch.randn(4, 8), 8, 16), "score_mod").canonical
    alibi = trace(library.alibi(torch.rand(4)), "score_mod").canonical
    plain = Config(64, 128, 8, 3, 128, 64, 8, 3, tma=1)
    for dim in (64, 128):
        spec = AttentionBwdSpec(head_dim=dim, q_per_kv=4, dtype="bf16", score_mod=bias)
        [(_, config)] = default_rule(spec, h200)
        assert feasible(spec, config, h200) is None
        assert feasible(spec, plain, h200) is not None or dim == 64
        assert default_rule(spec.replace(score_mod=alibi), h200)[-1][1] != config  # no gather: the usual tiles


def test_a_step_that_no_differentiated_tensor_reaches_trains(device):
    """A float // over a captured tensor that does not require grad has no derivative to form (the score's is 1);
    the same tensor requiring grad is refused by name before any kernel runs."""
    scale = torch.tensor([0.7, 1.3], device=device)

    def stepped(score, b, h, q_idx, kv_idx):
        return score + (scale[h] * (kv_idx - q_idx)) // 1.0

    q, k, v = _leaves([(1, 2, 17, D)] * 3, torch.float32, device, 3)
    got = torch.autograd.grad(tilegen.attention(q, k, v, score_mod=stepped).sum(), [q, k, v])
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_reference(*leaves64, score_mod=stepped)[0].sum(), leaves64)
    for g, r in zip(got, ref):
        assert _error(g, r) < TOL[torch.float32]
    scale.requires_grad_()
    with pytest.raises(ModGradError, match=r"captured tensor t0 of the score mod requires grad, and score_mod: the "
                                           r"derivative of floordiv"):
        tilegen.attention(q, k, v, score_mod=stepped)


@pytest.mark.parametrize("mods", ["score", "mask"])
@pytest.mark.parametrize("op", ["dense", "varlen"])
def test_a_second_derivative_with_mods_is_refused_by_name(mods, op, device):
    """create_graph=True gives gradients whose own backward refuses, as the ops without mods do; before, they had
    no grad_fn, so a gradient penalty's term was silently dropped."""
    kwargs = {"score_mod": library.alibi(torch.rand(2, device=device))} if mods == "score" else {
        "mask_mod": library.document_mask(torch.tensor([0] * 4 + [1] * 5, device=device))}
    q, k, v = _leaves([(1, 2, 9, D)] * 3, torch.float32, device, 5)
    if op == "dense":
        out = tilegen.attention(q, k, v, **kwargs)
        name = "tilegen.attention"
    else:
        cu = torch.tensor([0, 9], dtype=torch.int32, device=device)
        out = tilegen.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 9, 9,
                                       **kwargs)
        name = "tilegen.varlen_attention"
    (dk,) = torch.autograd.grad(out.sum(), k, create_graph=True)
    assert dk.grad_fn is not None
    with pytest.raises(NotImplementedError, match=rf"{name}: the second derivative \(double backward\) of attention "
                                                  "with mods is not implemented"):
        (dk * dk).sum().backward()


def test_a_parameter_a_mod_closes_over_takes_its_gradient(device):
    """Learned ALiBi slopes as an nn.Parameter in the mod's closure (fx takes parameters from a traced module only;
    tilegen's tracer takes them as captured tensors)."""
    slopes = torch.nn.Parameter(torch.rand(2, device=device))
    q, k, v = _leaves([(1, 2, 17, D)] * 3, torch.float32, device, 9)
    tilegen.attention(q, k, v, score_mod=library.alibi(slopes), causal=True).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    slopes64 = slopes.detach().double().requires_grad_()
    attention_reference(*leaves64, causal=True, score_mod=library.alibi(slopes64))[0].sum().backward()
    assert _error(slopes.grad, slopes64.grad) < TOL[torch.float32]
    assert _error(q.grad, leaves64[0].grad) < TOL[torch.float32]
