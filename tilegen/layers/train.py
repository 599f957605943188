"""Training the blockwise layer: BPT's backward, one block of query tokens at a time.

The forward is the inference schedule (the ``blockwise_layer`` family's generated module) with
one change: its attention calls go through a ``Recorder``, which also keeps each block's
attention output and LSE; its query block is at most ``MAX_TRAINING_BLOCK``. That, the layer's
input and the weights are all a training forward keeps: nothing of the FFN's ``[tokens, d_ffn]``
width, no K, V or q.

The backward, per block, recomputes what it needs and differentiates it:
  1. ``h = x + attn @ o_proj^T`` from the kept attention output, then the FFN (norm, MLP,
     residual) ``ffn_recompute_rows`` at a time, differentiated by hand: dh, and the FFN
     weights' gradients summed in fp32 inside the GEMMs;
  2. attention's backward over the keys the block saw (``tilegen::attention_bwd``, from the
     kept output and LSE, q and K/V recomputed as the forward made them), dQ into q_proj and the
     input norm, dK and dV summed over the blocks into sequence-sized fp32 buffers;
  3. once every block is done, K and V's projections and the input norm, block by block.
So the widest things alive are K, V, their gradients and one block's FFN intermediates.
Weight gradients are summed in fp32 and handed back in the weights' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tilegen.layers.config import LayerConfig
from tilegen.layers.reference import rope_tables
from tilegen.ops.attention import attention, prepare_call
from tilegen.ops.rope import apply_rope

__all__ = ["FFN_RECOMPUTE_BYTES", "MAX_TRAINING_BLOCK", "LayerFunction", "Recorder", "ffn_recompute_rows"]


class Recorder:
    """Stands in for ``tilegen.attention`` in the layer's schedule during a training forward: it runs
    attention with the LSE and keeps, per block in call order, its rows, its key range, its mask
    arguments, and attention's output rows and LSE."""

    def __init__(self, n: int, config: LayerConfig, like: torch.Tensor):
        self.out = like.new_empty(n, config.heads_q * config.head_dim)
        self.lse = torch.empty(config.heads_q, n, dtype=torch.float32, device=like.device)
        self.blocks: list[tuple[int, int, int, int, dict]] = []
        self._next = 0

    def __call__(self, q, k, v, *, out, **kwargs):
        rows = q.shape[2]
        # k is a view k_all[k0:k1] of the schedule's [n_tokens, heads_kv * head_dim] keys.
        k0 = k.storage_offset() // k.stride(2)
        _, lse = attention(q, k, v, out=out, return_lse=True, **kwargs)
        start = self._next
        self._next += rows
        self.out[start:start + rows] = out[0].transpose(0, 1).reshape(rows, -1)
        self.lse[:, start:start + rows] = lse[0]
        self.blocks.append((start, start + rows, k0, k0 + k.shape[2], kwargs))
        return out


class LayerFunction(torch.autograd.Function):
    """``out = layer(x)`` with BPT's block-by-block backward. ``run(x_seq, w, out_seq, attention)`` runs the
    layer's schedule on one sequence with ``attention`` standing in for ``tilegen.attention``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, config: LayerConfig, run: Callable, names: tuple[str, ...], *weights):
        w = dict(zip(names, weights))
        out = torch.empty_like(x)
        recorders = []
        for x_seq, out_seq in (zip(x.unbind(0), out.unbind(0)) if x.dim() == 3 else [(x, out)]):
            recorder = Recorder(x_seq.shape[0], config, x_seq)
            if x_seq.shape[0]:
                run(x_seq, w, out_seq, recorder)
            recorders.append(recorder)
        ctx.save_for_backward(x, *weights)
        ctx.config, ctx.names, ctx.recorders = config, names, recorders
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        if torch.is_grad_enabled():
            raise NotImplementedError("tilegen.blockwise_layer: the second derivative (double backward) is not "
                                      "implemented; differentiate once (create_graph=False)")
        x, *weights = ctx.saved_tensors
        w = dict(zip(ctx.names, weights))
        # fp32 sums only for the weights that want a gradient: a frozen backbone's would be weight-sized buffers and
        # GEMMs thrown away (``_add_product`` skips a name that has none).
        grads = {name: torch.zeros_like(t, dtype=torch.float32) for i, (name, t) in enumerate(w.items())
                 if ctx.needs_input_grad[4 + i]}
        dx = torch.empty_like(x)
        sequences = zip(x.unbind(0), dout.unbind(0), dx.unbind(0)) if x.dim() == 3 else [(x, dout, dx)]
        for (x_seq, dout_seq, dx_seq), recorder in zip(sequences, ctx.recorders):
            _sequence_backward(x_seq, dout_seq, dx_seq, w, ctx.config, recorder, grads)
        # One weight at a time, each fp32 sum freed as its copy in the weight's dtype is made: all of them
        # in both dtypes at once would add half the fp32 sums to the step's peak.
        dw = []
        for name, t in w.items():
            total = grads.pop(name, None)
            dw.append(None if total is None else total.to(t.dtype))
            del total
        return (dx if ctx.needs_input_grad[0] else None), None, None, None, *dw


def _sequence_backward(x, dout, dx, w, config: LayerConfig, recorder: Recorder, grads) -> None:
    n = x.shape[0]
    if n == 0:
        return
    hq, hkv, hd = config.heads_q, config.heads_kv, config.head_dim
    blocks = recorder.blocks
    tables = _RopeTables(config, x.device)

    def as_heads(t, heads):  # [rows, heads * head_dim] -> attention's [1, heads, rows, head_dim]
        return t.view(t.shape[0], heads, hd).transpose(0, 1)[None]

    # K and V of the whole sequence, made as the schedule made them, a block at a time.
    k_all = x.new_empty(n, hkv * hd)
    v_all = x.new_empty(n, hkv * hd)
    for start, end, *_ in blocks:
        xn = _input_norm(x[start:end], w, config)
        torch.matmul(xn, w["self_attn.k_proj.weight"].T, out=k_all[start:end])
        tables.rotate(k_all[start:end], hkv, start, end)
        torch.matmul(xn, w["self_attn.v_proj.weight"].T, out=v_all[start:end])
    dk_all = torch.zeros(n, hkv * hd, dtype=torch.float32, device=x.device)
    dv_all = torch.zeros_like(dk_all)

    ffn_rows = ffn_recompute_rows(config, x.element_size())
    w_o = w["self_attn.o_proj.weight"]
    for start, end, k0, k1, kwargs in blocks:
        rows = end - start
        attn = recorder.out[start:end]
        # 1. The FFN, recomputed from h, ffn_rows at a time: a schedule's block of 16k rows would otherwise
        # hold several [rows, d_ffn] intermediates (GBs at Llama-8B widths).
        dh = torch.empty_like(x[start:end])  # h's gradient: d_model wide, as x (attention's width may differ)
        for c0 in range(start, end, ffn_rows):
            c1 = min(c0 + ffn_rows, end)
            h = torch.addmm(x[c0:c1], recorder.out[c0:c1], w_o.T)
            dh[c0 - start:c1 - start] = _ffn_backward(h, dout[c0:c1], w, config, grads)
            del h
        _add_product(grads, "self_attn.o_proj.weight", dh.T, attn)
        d_attn = dh @ w_o
        # 2. Attention's backward over the keys this block saw.
        xn, norm_backward = _input_norm_graph(x[start:end], w, config)
        q = xn @ w["self_attn.q_proj.weight"].T
        tables.rotate(q, hq, start, end)
        k, v = as_heads(k_all[k0:k1], hkv), as_heads(v_all[k0:k1], hkv)
        spec, left, right, scale, softcap = prepare_call(as_heads(q, hq), k, v, kwargs.get("causal", False),
                                                         kwargs.get("window"), kwargs.get("softcap"),
                                                         kwargs.get("scale"), True)
        dq, dk, dv = torch.ops.tilegen.attention_bwd(
            as_heads(d_attn, hq), as_heads(q, hq), k, v, as_heads(attn, hq), recorder.lse[None, :, start:end], None,
            # As tilegen.attention's backward: no atomics under torch.use_deterministic_algorithms(True).
            spec.mask, spec.softcap, scale, softcap, left, right, torch.are_deterministic_algorithms_enabled())
        # Added through a head-major view of the sums: a reshape of the transposed gradient would copy it first.
        dk_all[k0:k1].view(k1 - k0, hkv, hd).add_(dk[0].transpose(0, 1))
        dv_all[k0:k1].view(k1 - k0, hkv, hd).add_(dv[0].transpose(0, 1))
        del dk, dv
        dq = tables.unrotate(dq[0].transpose(0, 1).reshape(rows, -1), hq, start, end)
        _add_product(grads, "self_attn.q_proj.weight", dq.T, xn)
        # The residual, and q's path back through the input norm.
        dxn = dq @ w["self_attn.q_proj.weight"]
        dx[start:end] = norm_backward(dxn, grads).add_(dh)
        # Before the next block's FFN chunks: this block's temporaries would otherwise live on beside them.
        del dh, d_attn, q, dq, dxn, xn, norm_backward

    # 3. K and V's projections and the input norm, now that every block has added to dK and dV.
    w_k, w_v = w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]
    for start, end, *_ in blocks:
        xn, norm_backward = _input_norm_graph(x[start:end], w, config)
        dk = tables.unrotate(dk_all[start:end], hkv, start, end).to(x.dtype)
        dv = dv_all[start:end].to(x.dtype)
        _add_product(grads, "self_attn.k_proj.weight", dk.T, xn)
        _add_product(grads, "self_attn.v_proj.weight", dv.T, xn)
        dxn = torch.addmm(dk @ w_k, dv, w_v)
        dx[start:end] = norm_backward(dxn, grads).add_(dx[start:end])
        del dk, dv, dxn, xn, norm_backward


#: The query block a training forward takes at most (an explicit ``block`` aside): the backward holds one
#: block's q, dO, gradients and norm graph at once, so its peak grows with the block while its time barely
#: moves. On the H200 (Llama-3-8B's layer, bf16, one training step at 65536 tokens, ``python -m
#: tilegen.bench.blockwise --train --no-fit --lengths 65536 --blocks 2048,4096,8192,16384``): blocks of 16384
#: (the inference row) 5.71 GB / 518 ms, 8192 4.51 GB / 520 ms, 4096 3.97 GB / 533 ms, 2048 3.90 GB / 548 ms.
MAX_TRAINING_BLOCK = 4096

#: What one recomputed FFN chunk's [rows, d_ffn] tensor may take: its backward holds about five at once
#: (gate and up projections, the activation, their gradients).
FFN_RECOMPUTE_BYTES = 64 << 20


def ffn_recompute_rows(config: LayerConfig, itemsize: int) -> int:
    """Rows of the FFN the backward recomputes at once: the largest power of two (at most 4096, at least 64)
    whose [rows, d_ffn] tensor fits ``FFN_RECOMPUTE_BYTES``. At Llama-3-8B's width (14336, bf16), 2048: its
    GEMMs still fill an H200, and the chunk's intermediates stay near 0.5 GB whatever the schedule's block."""
    rows = 4096
    while rows > 64 and rows * config.d_ffn * itemsize > FFN_RECOMPUTE_BYTES:
        rows //= 2
    return rows


def _add_product(grads: dict, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``grads[name] += a @ b`` (nothing where ``name`` has no sum: a frozen weight), the sum fp32 and ``a``, ``b``
    in the layer's dtype. On CUDA one GEMM adds the half-precision product to the sum in fp32 (``out_dtype``), in
    place: an fp32 copy of the operands would multiply at a fraction of the tensor cores' rate, and a result apart
    from the sum would first be a copy of it (addmm's beta term), a weight-sized device copy per call (3.7 ms of a
    16k-token step at Llama-3-8B widths on the H200)."""
    acc = grads.get(name)
    if acc is None:  # a frozen weight
        return
    if acc.is_cuda and a.dtype != acc.dtype:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # a torch without addmm's out_dtype overload
            pass
    acc += (a @ b).to(acc.dtype) if a.dtype != acc.dtype else a @ b


def _ffn_backward(h, dy, w, config: LayerConfig, grads) -> torch.Tensor:
    """d(h) of ``y = h + mlp(norm(h))`` (``ffn_residual``) on a chunk of rows, given d(y). The MLP's weight
    gradients go into their fp32 sums by GEMMs that accumulate (``_add_product``): autograd would hand back a
    weight-sized gradient per chunk, and adding those into the sums moved more bytes than the GEMMs took."""
    hn, norm_backward = _norm_graph(h, w, "post_attention_layernorm", config)
    w_up, w_down = w["mlp.up_proj.weight"], w["mlp.down_proj.weight"]
    up = hn @ w_up.T
    if config.ffn == "swiglu":
        gate = hn @ w["mlp.gate_proj.weight"].T
        silu = F.silu(gate)
        act = silu * up
    else:
        act = F.gelu(up)
    _add_product(grads, "mlp.down_proj.weight", dy.T, act)
    del act
    d_act = dy @ w_down
    if config.ffn == "swiglu":
        d_up = d_act * silu
        del silu
        d_gate = torch.ops.aten.silu_backward(d_act * up, gate)
        del gate, up, d_act
        _add_product(grads, "mlp.gate_proj.weight", d_gate.T, hn)
        d_hn = d_gate @ w["mlp.gate_proj.weight"]
        del d_gate
    else:
        d_up = torch.ops.aten.gelu_backward(d_act, up)
        del up, d_act
        d_hn = None
    _add_product(grads, "mlp.up_proj.weight", d_up.T, hn)
    d_hn = d_up @ w_up if d_hn is None else d_hn.addmm_(d_up, w_up)
    del d_up, hn
    return norm_backward(d_hn, grads).add_(dy).to(h.dtype)


def _norm(x, weight, bias, config: LayerConfig) -> torch.Tensor:
    """The layer's norm by torch's fused kernels: the formula of ``tilegen.layers.reference.norm`` (fp32 inside,
    one rounding to ``x``'s dtype), where that formula's elementwise ops, and their autograd, would make about
    ten passes over a block's activations."""
    shape = (x.shape[-1],)
    if config.norm == "layernorm":
        return F.layer_norm(x, shape, weight, bias, config.eps)
    return F.rms_norm(x, shape, weight, config.eps)


def _input_norm(x, w, config: LayerConfig) -> torch.Tensor:
    return _norm(x, w["input_layernorm.weight"], w.get("input_layernorm.bias"), config)


def _input_norm_graph(x, w, config: LayerConfig):
    return _norm_graph(x, w, "input_layernorm", config)


def _norm_graph(x, w, prefix: str, config: LayerConfig):
    """One block's norm (weights ``{prefix}.weight`` and ``.bias``), computed once under autograd:
    ``(xn, backward)``, where ``backward(dxn, grads)`` returns d(input) in fp32 and adds the norm weight's
    (and bias's) gradient to ``grads``; call it once."""
    names = [name for name in (f"{prefix}.weight", f"{prefix}.bias") if name in w]
    with torch.enable_grad():
        xl = x.detach().requires_grad_()
        leaves = [w[name].detach().requires_grad_() for name in names]
        xn = _norm(xl, leaves[0], leaves[1] if len(leaves) > 1 else None, config)

    def backward(dxn, grads) -> torch.Tensor:
        dxl, *dnorm = torch.autograd.grad(xn, [xl, *leaves], dxn.to(xn.dtype))
        for name, g in zip(names, dnorm):
            if name in grads:
                grads[name] += g
        return dxl.float()

    return xn.detach(), backward


class _RopeTables:
    """The schedule's rotary embedding (``tilegen.apply_rope`` with fp32 tables from fp64 angles) and
    its transpose, for rows ``start..end`` of the sequence; nothing when the layer has none."""

    def __init__(self, config: LayerConfig, device):
        self.theta, self.head_dim, self.device = config.rope_theta, config.head_dim, device

    def _tables(self, start, end):
        return rope_tables(torch.arange(start, end, device=self.device), self.head_dim, self.theta, torch.float32)

    def rotate(self, t, heads, start, end) -> None:
        """Rotate ``t`` [rows, heads * head_dim] in place, as the forward did."""
        if self.theta is None:
            return
        view = t.view(t.shape[0], heads, self.head_dim)
        apply_rope(view, *self._tables(start, end), out=view)

    def unrotate(self, g, heads, start, end) -> torch.Tensor:
        """The gradient before the rotation, written over ``g`` [rows, heads * head_dim] (contiguous) and
        returned: the rotation's transpose, which is the rotation by the opposite angles (``sin`` negated:
        the tables repeat their halves, so sin commutes with rotate-half). One kernel in ``g``'s dtype,
        where fp32 torch arithmetic would hold several fp32 copies of a block's gradient."""
        if self.theta is None:
            return g
        cos, sin = self._tables(start, end)
        view = g.view(g.shape[0], heads, self.head_dim)
        apply_rope(view, cos, sin.neg(), out=view)
        return g
