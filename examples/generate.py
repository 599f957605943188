"""Greedy generation with continuous batching on a transformers Llama, its attention through tilegen's serving ops.

    python examples/generate.py                                   # CPU: Triton's interpreter, a tiny model
    python examples/generate.py --batch 1,8,64 --prompt 2048 --new 256 --layers 4 --dtype bf16 \\
        --out results.json                                        # a GPU: Llama-3-8B widths, 4 layers

The model is a ``LlamaForCausalLM`` with random weights (no download). ``Engine`` runs it with the
model's own weights (embedding, projections and MLP, LM head; its RMSNorms' weights through torch's fused
kernel; q, k and v joined into one product, and gate and up into another, their modules' weights becoming
views of the joined ones; the residual adds inside the output products) and tilegen's ops for everything
between the projections:

- a page pool: one ``[layers, pages + 1, page_size, kv_heads, head_dim]`` tensor each for K and V
  (the extra page is a scratch page that padded decode slots write into), a free list, pages
  reserved when a request is admitted and taken from the free list as its sequence grows, returned
  when it finishes;
- prefill of the requests admitted at a step, as one ragged batch: ``tilegen.apply_rope`` with the
  model's own rotary tables (``model.model.rotary_emb``, so Llama 3 / linear / YaRN scaling come
  with it), ``tilegen.append_kv`` of their K and V into their pages, ``tilegen.PagedAttention``
  (causal) over those pages; the LM head only on each prompt's last token; the step's offsets, pages,
  tokens and positions go up in one copy from pinned memory;
- a decode step for every running request: ``append_kv`` of the new token's K and V, then
  ``tilegen.PagedDecode``, the batch padded to a bucket (powers of two up to ``max_batch``). On a
  GPU each bucket's step is captured once in a CUDA graph (``PagedDecode`` is planned for the
  longest sequence the engine holds, so the plan, its split partials and every shape stay fixed)
  and replayed; the step's positions and page table go up in one copy before the replay. When no
  step's schedule depends on a token (no ``eos_token_id``, nothing forced, no logits kept), a step
  does not wait for its tokens (nor a prefill for its first tokens): the next step takes them on the
  device, the host prepares it while the GPU runs, and every token is read back once at the end.
  Otherwise the tokens go up with the table, each step waiting for the one before.
- continuous batching: requests wait in a queue (each may arrive at a later step), join the
  running batch when a slot, the prefill token budget and their pages allow, and leave it when
  they have their ``max_new_tokens`` (or hit ``eos_token_id``).

The command times, per batch size, the engine and transformers' own ``model.generate`` (sdpa; a
static cache, which transformers compiles with ``torch.compile`` on a GPU, else a dynamic cache:
the JSON says which ran) on the same prompts in the same run, whole generation runs timed with CUDA
events after a warm-up run, and reports the share of generated tokens identical to transformers'
greedy output (the first 32 per request, and all). With ``--kv-dtype`` it also serves the same
requests over FP8 pages, and compares their logits with the unquantized cache's teacher-forced (both fed
the unquantized cache's greedy tokens, so every step sees the same context).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from itertools import chain

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tilegen imports Triton

import tilegen  # noqa: E402
from tilegen.dtypes import KV_DTYPES  # noqa: E402
from tilegen.env import interpreting  # noqa: E402
from tilegen.ops.kv_cache import PAGE_SIZES  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Llama-3-8B's widths (the command's GPU model, with --layers of them).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
#: The CPU model: small enough for Triton's interpreter.
TINY = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, initializer_range=0.2)

# Rotary types whose tables depend on the sequence length transformers sees (not one table per position).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(eq=False)
class Request:
    """A prompt and how many tokens to generate; ``arrival`` is the engine step it may join at."""

    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # in token order
    length: int = 0  # tokens whose K and V are in the cache
    reserved: int = 0  # pages reserved for the whole request (taken from the free list as it grows)
    joined: int | None = None  # the step it was prefilled at
    finished: int | None = None  # the step it finished at
    # Teacher forcing: the tokens fed back instead of the engine's own argmax (output then holds these).
    forced: list[int] | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # each step's, with the engine's keep_logits


class _Bucket:
    """The decode step's static buffers for a padded batch of ``size`` (and its CUDA graph)."""

    def __init__(self, engine: Engine, size: int):
        self.size = size
        cap = engine.num_pages + size  # every real page, and a scratch page per padded slot
        self.n_meta = 4 * size + (size + 1) + cap
        device = engine.device
        self.meta = torch.zeros(self.n_meta, dtype=torch.int32, device=device)
        # Two pinned staging buffers, taken in turn: a step's copy up may still be queued behind the step before
        # while the host writes the next step's table; ``copied`` holds each buffer's last copy (an event).
        self.hosts = [torch.zeros(self.n_meta, dtype=torch.int32, pin_memory=device.type == "cuda") for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.host = self.hosts[0]
        s = size
        self.tokens, self.positions, self.last = self.meta[:s], self.meta[s:2 * s], self.meta[2 * s:3 * s]
        # Per slot, where its token comes from when the host does not know it yet: its slot in the tokens of the
        # step before (overlapped steps), else -1.
        self.src = self.meta[3 * s:4 * s]
        self.indptr, self.indices = self.meta[4 * s:5 * s + 1], self.meta[5 * s + 1:]
        self.cu = torch.arange(size + 1, dtype=torch.int32, device=device)  # one new token per sequence
        self.caches = [tilegen.PagedKVCache(engine.k_pages[i], engine.v_pages[i], self.indptr, self.indices,
                                            self.last, **engine.scales) for i in range(engine.n_layers)]
        # Until a step fills them, every slot is a padded one: a length-1 sequence on the scratch page.
        engine._fill(self, [])
        self.meta.copy_(self.host)
        self.decode = tilegen.PagedDecode()
        # Planned for the longest sequence the engine holds: the split count and chunk stay valid as
        # sequences grow, so the plan (and a graph of it) serves every step of this batch size.
        self.decode.plan(self.caches[0], heads_q=engine.heads, max_seqlen_k=engine.max_seq_len, q_dtype=engine.dtype)
        self.next = torch.zeros(size, dtype=torch.int64, device=device)
        # A static buffer, so that a captured step writes it too.
        self.logits = torch.zeros(size, engine.vocab, dtype=engine.dtype, device=device) if engine.keep_logits \
            else None
        self.graph: torch.cuda.CUDAGraph | None = None


class Engine:
    """Greedy generation over a paged KV cache with continuous batching (see the module docstring).

    Args:
        model: a ``LlamaForCausalLM``, or a Mistral (no sliding window) or Qwen2 causal LM, whose layers
            compute Llama's; its modules are called as they are, but for Llama's RMSNorms, which run torch's
            fused ``rms_norm`` with their weights. Another decoder (Qwen3, OLMo 2, Gemma, Granite, Phi-3, ...)
            is refused (``ValueError``): its layers do more than this engine writes out.
        page_size: tokens per page (one of ``tilegen.ops.kv_cache.PAGE_SIZES``).
        num_pages: pages in the pool; default enough for ``max_batch`` sequences of ``max_seq_len``.
        max_batch: most requests running at once.
        max_seq_len: most tokens a sequence may hold (prompt and generated); sizes the RoPE tables
            and the decode plans. Default: the model's ``max_position_embeddings``, at most 4096.
        prefill_tokens: most prompt tokens prefilled in one step (at least one request is admitted
            whatever its length).
        buckets: padded decode batch sizes; default powers of two below ``max_batch``, and it.
        cuda_graphs: capture each bucket's decode step in a CUDA graph (default: on a GPU).
        eos_token_id: stop a request when it generates this token (default: never).
        kv_dtype: the pages' dtype when not the model's: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``,
            quantized by ``append_kv`` with one scale per tensor, ``kv_scale`` (vLLM's default of 1.0 when
            nothing is calibrated).
        keep_logits: keep every step's logits in each request's ``logits`` (on the device, in the model's
            dtype), to compare two caches' logits over the same tokens (``Request.forced``).
    """

    def __init__(self, model, *, page_size: int = 16, num_pages: int | None = None, max_batch: int = 8,
                 max_seq_len: int | None = None, prefill_tokens: int = 16384, buckets=None,
                 cuda_graphs: bool | None = None, eos_token_id: int | None = None,
                 kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0, keep_logits: bool = False):
        _check_llama_form(model)
        inner = model.model
        config = model.config
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(f"model: rope_type {rope_type!r} changes its tables with the sequence length; "
                             "this engine takes one table per position")
        if getattr(config, "sliding_window", None) or getattr(config, "layer_types", None) and \
                any(t != "full_attention" for t in config.layer_types):
            raise ValueError("model: sliding-window layers are not supported by this engine")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: {page_size} is not supported; expected one of {PAGE_SIZES}")
        if max_batch < 1:
            raise ValueError(f"max_batch: expected at least 1, got {max_batch}")
        self.model = model
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        attn = self.layers[0].self_attn
        self.n_layers = len(self.layers)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        if abs(attn.scaling - self.head_dim ** -0.5) > 1e-12:
            raise ValueError(f"model: attention scale {attn.scaling} is not head_dim ** -0.5")
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab = weight.shape[0]
        self.page_size = page_size
        self.max_seq_len = max_seq_len or min(config.max_position_embeddings, 4096)
        self.max_batch = max_batch
        self.num_pages = num_pages if num_pages is not None else max_batch * math.ceil(self.max_seq_len / page_size)
        if self.num_pages < 1:
            raise ValueError(f"num_pages: expected at least 1, got {self.num_pages}")
        self.prefill_tokens = prefill_tokens
        self.eos_token_id = eos_token_id
        self.keep_logits = keep_logits
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs: the model is not on a CUDA device")
        if buckets is None:
            buckets = [b for b in (2 ** i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]
        self.buckets = sorted(set(int(b) for b in buckets))
        if self.buckets[0] < 1 or self.buckets[-1] < max_batch:
            raise ValueError(f"buckets: expected sizes >= 1 whose largest covers max_batch {max_batch}, got {buckets}")
        # The pool, and a scratch page (the last) for padded decode slots.
        shape = (self.n_layers, self.num_pages + 1, page_size, self.kv_heads, self.head_dim)
        self.k_pages = torch.zeros(shape, dtype=kv_dtype or self.dtype, device=self.device)
        self.v_pages = torch.zeros(shape, dtype=kv_dtype or self.dtype, device=self.device)
        scale = torch.full((1,), float(kv_scale), dtype=torch.float32, device=self.device)
        self.scales = {} if kv_dtype is None else {"k_scale": scale, "v_scale": scale}
        self.scratch = self.num_pages
        self.free: deque[int] = deque(range(self.num_pages))
        self.unreserved = self.num_pages
        # The model's rotary tables, one row per position, as transformers computes them (its own module).
        with torch.no_grad():
            positions = torch.arange(self.max_seq_len, device=self.device)[None]
            cos, sin = inner.rotary_emb(weight[:1], positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.fused = [_Fused.of(layer) for layer in self.layers]
        # On a GPU the activation is one kernel (torch.compile's), where eager torch makes two passes and a
        # temporary: 2.3 against 1.4 GB moved per layer for 16384 prefill rows at Llama-3-8B widths.
        self._silu_mul = _silu_mul_compiled if self.device.type == "cuda" else _silu_mul_eager
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.graph_errors: list[str] = []  # captures that failed (their buckets decode eagerly)
        self.page_log: list[tuple[int, int]] = []  # (request index, page) for every page the last call took
        self.stats: dict[str, int] = {}
        # Overlapped decode steps (``_decode``): the tokens still on the device, by step; the last step's tokens
        # and each of its requests' slot in them.
        self._overlap = False
        self._pending: list[tuple[list[Request], list[int], torch.Tensor]] = []
        self._carried: torch.Tensor | None = None
        self._slots: dict[int, int] = {}

    # ----------------------------------------------------------------- requests
    def check(self, request: Request) -> None:
        """Refuse a request the engine could never serve, before anything runs."""
        n = len(request.prompt)
        if n == 0:
            raise ValueError("prompt: empty; a request needs at least one token")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected at least 1, got {request.max_new_tokens}")
        bad = [t for t in request.prompt if not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:4]} outside the vocabulary of {self.vocab}")
        held = n + request.max_new_tokens - 1  # the last generated token is never fed back
        if held > self.max_seq_len:
            raise ValueError(f"prompt: {n} tokens and max_new_tokens {request.max_new_tokens} need {held} cache "
                             f"positions, past the engine's capacity of {self.max_seq_len} per sequence")
        if request.forced is not None and len(request.forced) < request.max_new_tokens:
            raise ValueError(f"forced: {len(request.forced)} tokens for max_new_tokens {request.max_new_tokens}")
        if request.forced is not None and any(not 0 <= int(t) < self.vocab for t in request.forced):
            raise ValueError(f"forced: token ids outside the vocabulary of {self.vocab}")
        if self._pages_for(held) > self.num_pages:
            raise ValueError(f"prompt: {n} tokens and max_new_tokens {request.max_new_tokens} need "
                             f"{self._pages_for(held)} pages, past the cache capacity of {self.num_pages} pages of "
                             f"{self.page_size}")

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _grow(self, index: int, r: Request, length: int) -> None:
        """Give ``r`` the pages ``length`` tokens need, from the free list (within its reservation)."""
        while len(r.pages) < self._pages_for(length):
            page = self.free.popleft()
            r.pages.append(page)
            self.page_log.append((index, page))
        r.length = length
        used = self.num_pages - len(self.free)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], used)

    def _release(self, r: Request) -> None:
        self.free.extend(r.pages)
        self.unreserved += r.reserved
        r.pages, r.reserved = [], 0

    # ----------------------------------------------------------------- the loop
    @torch.no_grad()
    def generate(self, requests: list[Request]) -> list[list[int]]:
        """Serve ``requests`` to the end; each one's generated tokens, in the order given."""
        for r in requests:
            self.check(r)
            r.output, r.pages, r.length, r.reserved, r.joined, r.finished = [], [], 0, 0, None, None
            r.logits = []
        self.stats = {"steps": 0, "prefills": 0, "decode_steps": 0, "graph_replays": 0, "padded_slots": 0,
                      "peak_pages": 0}  # of this call
        self.page_log = []
        # Steps overlap when no step's schedule depends on the tokens: retiring by count (no EOS), none forced,
        # no logits kept per step.
        self._overlap = self.eos_token_id is None and not self.keep_logits and all(r.forced is None for r in requests)
        self.stats["overlapped"] = int(self._overlap)
        self._pending, self._carried, self._slots = [], None, {}
        index = {id(r): i for i, r in enumerate(requests)}
        waiting = deque(sorted(requests, key=lambda r: r.arrival))  # stable: ties keep their order
        running: list[Request] = []
        step = 0
        while waiting or running:
            admitted: list[Request] = []
            budget = self.prefill_tokens
            while waiting and waiting[0].arrival <= step and len(running) + len(admitted) < self.max_batch:
                r = waiting[0]
                need = self._pages_for(len(r.prompt) + r.max_new_tokens - 1)
                if need > self.unreserved or (admitted and len(r.prompt) > budget):
                    break  # first come, first served: later requests wait behind it
                waiting.popleft()
                self.unreserved -= need
                r.reserved, r.joined = need, step
                budget -= len(r.prompt)
                admitted.append(r)
            if admitted:
                self._prefill(admitted, [index[id(r)] for r in admitted])
                running += admitted
            running = self._retire(running, step)
            if running:
                self._decode(running, [index[id(r)] for r in running])
                running = self._retire(running, step)
            step += 1
        self._resolve()
        self.stats["steps"] = step
        return [r.output for r in requests]

    def _retire(self, running: list[Request], step: int) -> list[Request]:
        kept = []
        for r in running:
            if len(r.output) >= r.max_new_tokens or (self.eos_token_id is not None and r.output
                                                      and r.output[-1] == self.eos_token_id):
                r.finished = step
                self._release(r)
            else:
                kept.append(r)
        return kept

    # ----------------------------------------------------------------- the model
    def _layer(self, layer, fused, h, cos, sin, cache, attend):
        """One decoder layer as transformers' ``LlamaDecoderLayer``, attention through tilegen. With ``fused``
        (``_Fused``), q, k and v come from one product, RoPE turns q and k in place in one call, the gated
        activation is one kernel, and the residual adds run inside the output products (into ``h`` in place:
        each caller's ``h`` is its own)."""
        n = h.shape[0]
        attn = layer.self_attn
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = _rms_norm(layer.input_layernorm, h)
        if fused is None:
            q = attn.q_proj(x).view(n, hq, d)
            k = attn.k_proj(x).view(n, hkv, d)
            v = attn.v_proj(x).view(n, hkv, d)
            q = tilegen.apply_rope(q, cos, sin)
            k = tilegen.apply_rope(k, cos, sin)
            o = attend(q, k, v, cache)
            h = h + attn.o_proj(o.reshape(n, hq * d))
            return h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
        qkv = torch.nn.functional.linear(x, fused.qkv)
        qk = qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d)
        tilegen.apply_rope(qk, cos, sin, out=qk)
        o = attend(qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d:].view(n, hkv, d), cache)
        h.addmm_(o.reshape(n, hq * d), attn.o_proj.weight.t())
        x = _rms_norm(layer.post_attention_layernorm, h)
        return h.addmm_(self._silu_mul(torch.nn.functional.linear(x, fused.gate_up)), layer.mlp.down_proj.weight.t())

    def _logits(self, h):
        return self.lm_head(_rms_norm(self.norm, h))

    def _prefill(self, admitted: list[Request], indices: list[int]) -> None:
        """Prefill the admitted requests as one ragged batch and append each one's first generated token to its
        ``output``: at once, or, when steps overlap, as ``None`` until ``_resolve`` (the next decode step takes it
        on the device, as it takes a decode step's)."""
        self.stats["prefills"] += 1
        lens = [len(r.prompt) for r in admitted]
        for i, r in zip(indices, admitted):
            self._grow(i, r, len(r.prompt))
        n_seq, total = len(admitted), sum(lens)
        # Offsets, page table, tokens and positions go up in one copy from pinned memory, which does not wait for
        # the GPU (a copy from pageable memory waits for the queued steps, and the GPU then idles while the host
        # builds the rest).
        offsets, page_offsets = [0], [0]
        for n, r in zip(lens, admitted):
            offsets.append(offsets[-1] + n)
            page_offsets.append(page_offsets[-1] + len(r.pages))
        values = array("i", offsets)
        values += array("i", page_offsets)
        values += array("i", chain.from_iterable(r.pages for r in admitted))
        values += array("i", [n - (len(r.pages) - 1) * self.page_size for n, r in zip(lens, admitted)])
        values += array("i", chain.from_iterable(r.prompt for r in admitted))
        values += array("i", chain.from_iterable(map(range, lens)))
        meta = torch.frombuffer(values, dtype=torch.int32)
        if self.device.type == "cuda":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
        cu, indptr, page_ids, last, tokens, positions = meta.split(
            [n_seq + 1, n_seq + 1, page_offsets[-1], n_seq, total, total])
        caches = [tilegen.PagedKVCache(self.k_pages[i], self.v_pages[i], indptr, page_ids, last, **self.scales)
                  for i in range(self.n_layers)]
        paged = tilegen.PagedAttention()
        paged.plan(cu, caches[0], heads_q=self.heads, causal=True, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                   q_dtype=self.dtype)

        def attend(q, k, v, cache):
            tilegen.append_kv(cache, k, v, cu)
            return paged.run(q, cache)

        h = self.embed(tokens)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer, fused, cache in zip(self.layers, self.fused, caches):
            h = self._layer(layer, fused, h, cos, sin, cache, attend)
        logits = self._logits(h[cu[1:] - 1])
        if self.keep_logits:
            for r, row in zip(admitted, logits):
                r.logits.append(row)
        first = logits.argmax(-1)
        if not self._overlap:
            for r, token in zip(admitted, first.tolist()):
                r.output.append(_fed(r, token))
            return
        # Carried beside the last decode step's tokens, which the requests already running take theirs from.
        base = 0 if self._carried is None else self._carried.shape[0]
        self._carried = first if self._carried is None else torch.cat([self._carried, first])
        for i, r in enumerate(admitted):
            self._slots[id(r)] = base + i
            r.output.append(None)
        self._pending.append((list(admitted), [0] * n_seq, first))

    def _bucket(self, batch: int) -> _Bucket:
        size = next(b for b in self.buckets if b >= batch)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(self, size)
            if self.cuda_graphs:
                self._capture(bucket)
        return bucket

    def _decode_step(self, b: _Bucket) -> None:
        """The padded decode step on ``b``'s static buffers; the next tokens land in ``b.next``."""
        def attend(q, k, v, cache):
            tilegen.append_kv(cache, k, v, b.cu)
            return b.decode.run(q, cache)

        h = self.embed(b.tokens)
        cos, sin = self.cos.index_select(0, b.positions), self.sin.index_select(0, b.positions)
        for layer, fused, cache in zip(self.layers, self.fused, b.caches):
            h = self._layer(layer, fused, h, cos, sin, cache, attend)
        logits = self._logits(h)
        b.next.copy_(logits.argmax(-1))
        if b.logits is not None:
            b.logits.copy_(logits)

    def _capture(self, b: _Bucket) -> None:
        # Warm up on a side stream (Triton compiles, the plans' first launches choose their configs), then
        # capture. The buffers describe padded slots only, so these runs write nothing but the scratch page.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                self._decode_step(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (Triton's, torch's) do not break this capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), torch.no_grad():
                self._decode_step(b)
        except Exception as e:  # noqa: BLE001 - this bucket then runs eagerly; the error is reported
            torch.cuda.synchronize(self.device)
            self.graph_errors.append(f"batch {b.size}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(f"CUDA graph capture failed, batch {b.size} decodes eagerly: {self.graph_errors[-1]}",
                  file=sys.stderr)
            return
        torch.cuda.synchronize(self.device)
        b.graph = graph

    def warmup(self) -> None:
        """Make every bucket (planned, and captured when graphs are on), largest first (graphs share a pool)."""
        for size in reversed(self.buckets):
            self._bucket(size)

    def _fill(self, b: _Bucket, running: list[Request], src: list[int] | None = None) -> int:
        """Write the step's tokens, positions and page table into ``b.host``; how many entries are used. A token
        still on the device (``None`` in ``output``) is written as 0, and ``src`` says where it is."""
        s, n = b.size, len(running)
        pad = s - n
        tokens = [0 if r.output[-1] is None else r.output[-1] for r in running] + [0] * pad
        src = (src or [-1] * n) + [-1] * pad
        positions = [r.length - 1 for r in running] + [0] * pad  # the new token's: lengths already grown
        last = [r.length - (len(r.pages) - 1) * self.page_size for r in running] + [1] * pad
        indptr, indices = [0], []
        for r in running:
            indices += r.pages
            indptr.append(len(indices))
        for _ in range(pad):
            indices.append(self.scratch)
            indptr.append(len(indices))
        values = tokens + positions + last + src + indptr + indices
        b.host[:len(values)] = torch.frombuffer(array("i", values), dtype=torch.int32)  # a third of torch.tensor's time
        return len(values)

    def _decode(self, running: list[Request], indices: list[int]) -> None:
        """One decode step for every running request, each one's next token appended to its ``output``: at once,
        or, when the step overlaps (``_overlap``), as ``None`` until ``_resolve`` reads it. An overlapped step
        does not wait for its tokens: the next step takes them from it on the device, so that the host prepares
        that step (pages, table, copy up) while this one runs, where a wait per step would leave the GPU idle
        for all of the host's work."""
        self.stats["decode_steps"] += 1
        for i, r in zip(indices, running):
            self._grow(i, r, r.length + 1)  # the page table includes the token being appended
        n = len(running)
        b = self._bucket(n)
        src = [self._slots[id(r)] if r.output[-1] is None else -1 for r in running] if self._overlap else None
        turn, b.turn = b.turn, b.turn ^ 1
        if b.copied[turn] is not None:
            b.copied[turn].synchronize()  # that buffer's copy up, two steps back, has run
        b.host = b.hosts[turn]
        used = self._fill(b, running, src)
        self.stats["padded_slots"] += b.size - n
        b.meta[:used].copy_(b.host[:used], non_blocking=True)
        if b.meta.is_cuda:
            b.copied[turn] = torch.cuda.Event()
            b.copied[turn].record()
        if src is not None and any(i >= 0 for i in src):
            slots = b.src[:n]
            carried = self._carried.index_select(0, slots.clamp(min=0)).to(torch.int32)
            b.tokens[:n].copy_(torch.where(slots >= 0, carried, b.tokens[:n]))
        if b.graph is not None:
            b.graph.replay()
            self.stats["graph_replays"] += 1
        else:
            self._decode_step(b)
        if b.logits is not None:
            for r, row in zip(running, b.logits.clone()):
                r.logits.append(row)
        if self._overlap:
            # A copy: the bucket's next step overwrites ``b.next``.
            self._carried = b.next[:n].clone()
            self._slots = {id(r): i for i, r in enumerate(running)}
            self._pending.append((list(running), [len(r.output) for r in running], self._carried))
            for r in running:
                r.output.append(None)
            return
        for r, token in zip(running, b.next[:n].tolist()):
            r.output.append(_fed(r, token))

    def _resolve(self) -> None:
        """Write the overlapped steps' tokens into the outputs that wait for them (one wait for the device)."""
        if not self._pending:
            return
        values = iter(torch.cat([tokens for *_, tokens in self._pending]).tolist())
        for requests, positions, _ in self._pending:
            for r, at in zip(requests, positions):
                r.output[at] = next(values)
        self._pending = []


# Models whose decoder computes Llama's layer as ``Engine._layer`` writes it (norm, q/k/v, RoPE, attention, o,
# norm, MLP; the embedding unscaled, the logits as the head gives them). Others that share the module names do
# something more: Qwen3 and OLMo 2 normalize q and k, Gemma scales the embedding, Granite multiplies the embedding,
# residuals and logits, Phi-3 joins q, k and v in one module: run here, their tokens would be silently wrong.
_LLAMA_FORMS = ("LlamaModel", "MistralModel", "Qwen2Model")
_ATTENTION_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj"}


def _check_llama_form(model) -> None:
    inner = getattr(model, "model", None)
    form = type(inner).__name__
    if form not in _LLAMA_FORMS or not hasattr(model, "lm_head"):
        raise ValueError(f"model: {type(model).__name__} (a {form}) is not a decoder this engine computes; it runs "
                         f"Llama's layer as written, for {', '.join(_LLAMA_FORMS)} with an lm_head")
    for i, layer in enumerate(inner.layers):
        modules = {name for name, _ in layer.self_attn.named_children()} - {"rotary_emb"}
        if modules != _ATTENTION_MODULES:
            raise ValueError(f"model: layer {i}'s attention has modules {sorted(modules)}; this engine runs "
                             f"{sorted(_ATTENTION_MODULES)} alone")


def _rms_norm(module, h: torch.Tensor) -> torch.Tensor:
    """``module(h)`` for transformers' ``LlamaRMSNorm`` by torch's fused kernel (one pass over ``h``, where the
    module's fp32 elementwise ops make about seven: 895 against 83 µs for 16384 x 4096 bf16 rows on the H200). The
    weight multiplies in fp32 before the one rounding, where the module rounds first: equal in fp32, one bf16
    rounding apart in bf16. Any other norm module is called as it is (Gemma's, say, scales by 1 + weight)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ == "LlamaRMSNorm" and isinstance(weight, torch.Tensor) and eps is not None:
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)
    return module(h)


class _Fused:
    """A layer's q, k, v projection weights as one matrix, and its gate and up weights as another, where the
    layer is plain Llama (no biases, SiLU): the modules' weights become views of them, so the model holds no
    extra copy and still runs as it did. Two products a layer where there were five, so fewer, fuller launches
    (a decode step's products are a read of the weights). None for a layer of another form."""

    def __init__(self, qkv: torch.Tensor, gate_up: torch.Tensor):
        self.qkv, self.gate_up = qkv, gate_up

    @classmethod
    def of(cls, layer) -> _Fused | None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(m, name, None) for m, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                           (mlp, ("gate_proj", "up_proj", "down_proj")))
                   for name in names]
        if not all(isinstance(m, torch.nn.Linear) and m.bias is None for m in linears) or \
                type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):  # torch's, transformers'
            return None
        q, k, v, _, gate, up, _ = linears
        return cls(_one_matrix(q, k, v), _one_matrix(gate, up))


def _one_matrix(*linears: torch.nn.Linear) -> torch.Tensor:
    """The linears' weights stacked by rows into one tensor of which each weight is then a view (once: weights
    that already lie one after the other are viewed as they are)."""
    weights = [m.weight for m in linears]
    rows = sum(w.shape[0] for w in weights)
    first = weights[0]
    at = first.storage_offset()
    if all(w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           for w in weights):
        offsets = [w.storage_offset() for w in weights]
        if all(o == at + sum(x.numel() for x in weights[:i]) for i, o in enumerate(offsets)):
            return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))
    with torch.no_grad():
        joined = torch.cat([w.detach() for w in weights])
    row = 0
    for m, w in zip(linears, weights):
        m.weight = torch.nn.Parameter(joined[row:row + w.shape[0]], requires_grad=w.requires_grad)
        row += w.shape[0]
    return joined


def _silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """Llama's gated activation on the joined gate and up products: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


_silu_mul_static = torch.compile(_silu_mul_eager, dynamic=False)


def _silu_mul_compiled(gate_up: torch.Tensor) -> torch.Tensor:
    # Only the row count varies: a kernel compiled with the width symbolic too divides by it per element (0.90
    # against 0.32 ms for 16384 x 28672 bf16 on the H200).
    torch._dynamo.maybe_mark_dynamic(gate_up, 0)
    return _silu_mul_static(gate_up)


def _fed(r: Request, token: int) -> int:
    """The token ``r`` feeds back: its forced one, else the engine's own."""
    return token if r.forced is None else int(r.forced[len(r.output)])


# --------------------------------------------------------------------- the command
def build_model(dims: dict, layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A ``LlamaForCausalLM`` of ``dims`` with ``layers`` layers and random weights, sdpa attention, eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**dims, num_hidden_layers=layers, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):  # built in its dtype: the rotary inverse frequencies stay fp32, as loaded models'
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def hf_generate(model, prompts: torch.Tensor, new: int, cache: str):
    """transformers' greedy ``generate`` of exactly ``new`` tokens per prompt; the new tokens."""
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(prompts, **kwargs)
    if out.shape[1] != prompts.shape[1] + new:
        raise RuntimeError(f"transformers generated {out.shape[1] - prompts.shape[1]} tokens, expected {new}")
    return out[:, prompts.shape[1]:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fn, device: torch.device, runs: int) -> list[float]:
    """Seconds of each of ``runs`` whole calls of ``fn`` (after the caller's warm-up): CUDA events on a GPU."""
    times = []
    for _ in range(runs):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def match_share(ours: list[list[int]], ref: list[list[int]], first: int | None = None) -> float:
    """Share of positions (the first ``first`` per request, or all) where the two greedy outputs agree."""
    same = total = 0
    for a, b in zip(ours, ref):
        n = min(len(b), first) if first else len(b)
        same += sum(1 for x, y in zip(a[:n], b[:n]) if x == y)
        total += n
    return same / total if total else float("nan")


#: Most bytes the teacher-forced comparison keeps in logits (both runs', in the model's dtype).
_LOGIT_BYTES = 4 << 30


def logit_agreement(model, prompts: list[list[int]], new: int, kv_dtype: torch.dtype, **engine_args) -> dict:
    """Teacher-forced comparison of a quantized cache with the model's own: the unquantized cache's greedy
    tokens are fed to both, so every step sees the same context, and each (request, step) gives whether the
    quantized cache's top-1 token is the unquantized one's and max |logit difference| / max |logit|."""
    runs = []
    for kv in (None, kv_dtype):
        forced = [None] * len(prompts) if not runs else [r.output for r in runs[0]]
        requests = [Request(p, new, forced=f) for p, f in zip(prompts, forced)]
        Engine(model, kv_dtype=kv, keep_logits=True, **engine_args).generate(requests)
        runs.append(requests)
    same, errors = 0, []
    for ref, got in zip(*runs):
        a, b = torch.stack(ref.logits).float(), torch.stack(got.logits).float()
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        errors += ((b - a).abs().amax(-1) / a.abs().amax(-1)).tolist()
    return {"requests": len(prompts), "steps": new, "top1_agreement": same / len(errors),
            "rel_error_median": statistics.median(errors), "rel_error_max": max(errors)}


def bench_batch(model, batch: int, prompt_len: int, new: int, args, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    row: dict = {"batch": batch, "prompt": prompt_len, "new": new}
    # transformers first: its greedy tokens are the reference.
    ref = None
    for cache in (["static", "dynamic"] if args.hf_cache == "auto" else [args.hf_cache]):
        try:
            ref = hf_generate(model, prompts, new, cache).tolist()  # warm-up (and compile) run
            times = time_runs(lambda c=cache: hf_generate(model, prompts, new, c), device, args.runs)
            # transformers compiles the decode forward of a static cache on a GPU, keeping it here.
            compiled = cache == "static" and hasattr(model, "_compiled_call")
            row["hf"] = {"cache": cache, "torch_compile": bool(compiled), "s": statistics.median(times),
                         "runs_s": times, "tokens_per_s": batch * new / statistics.median(times)}
            break
        except Exception as e:  # noqa: BLE001 - recorded, then the next cache is tried
            row.setdefault("hf_errors", []).append(f"{cache}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            _sync(device)
    plist = prompts.tolist()
    budget = max(args.prefill_tokens[0], prompt_len)
    ours, row["tilegen"], engine = _time_engine(model, plist, batch, prompt_len, new, args, device, budget)
    # Further prefill budgets, on the same requests and against the same transformers run.
    row["tilegen_budgets"] = []
    for other in args.prefill_tokens[1:]:
        tokens, timed, _ = _time_engine(model, plist, batch, prompt_len, new, args, device, max(other, prompt_len))
        timed["same_tokens_as_first_budget"] = tokens == ours
        row["tilegen_budgets"].append(timed)
    if args.kv_dtype:
        # The same requests over FP8 pages: speed, and greedy agreement with the unquantized cache's tokens.
        fp8 = Engine(model, page_size=args.page_size, max_batch=batch, max_seq_len=prompt_len + new,
                     prefill_tokens=budget, cuda_graphs=engine.cuda_graphs,
                     kv_dtype=KV_DTYPES[args.kv_dtype], kv_scale=args.kv_scale)
        fp8.warmup()
        quantized = fp8.generate([Request(p, new) for p in plist])
        times = time_runs(lambda: fp8.generate([Request(p, new) for p in plist]), device, args.runs)
        row["fp8"] = {"kv_dtype": args.kv_dtype, "kv_scale": args.kv_scale, "s": statistics.median(times),
                      "tokens_per_s": batch * new / statistics.median(times),
                      "match_first32_vs_unquantized": match_share(quantized, ours, 32),
                      "match_all_vs_unquantized": match_share(quantized, ours),
                      "first_divergence": [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                           for x, y in zip(quantized, ours)]}
        del fp8
        logit_bytes = 2 * batch * new * model.config.vocab_size * torch.finfo(model.dtype).bits // 8
        if logit_bytes <= _LOGIT_BYTES:
            row["fp8"]["teacher_forced"] = logit_agreement(
                model, plist, new, KV_DTYPES[args.kv_dtype], page_size=args.page_size, max_batch=batch,
                max_seq_len=prompt_len + new, prefill_tokens=budget,
                cuda_graphs=engine.cuda_graphs, kv_scale=args.kv_scale)
        else:
            row["fp8"]["teacher_forced"] = {"skipped": f"{logit_bytes / 2**30:.1f} GiB of logits"}
    if ref is not None:
        row["match_first32"] = match_share(ours, ref, 32)
        row["match_all"] = match_share(ours, ref)
        row["requests_identical"] = sum(a == b for a, b in zip(ours, ref)) / batch
        row["hf_speedup"] = row["tilegen"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _time_engine(model, prompts: list[list[int]], batch: int, prompt_len: int, new: int, args, device: torch.device,
                 budget: int) -> tuple[list[list[int]], dict, Engine]:
    """The engine's greedy tokens for ``prompts`` (a warm-up run), its timed runs, and the engine."""
    engine = Engine(model, page_size=args.page_size, max_batch=batch, max_seq_len=prompt_len + new,
                    prefill_tokens=budget, cuda_graphs=not args.no_graphs and device.type == "cuda")

    def run():
        return engine.generate([Request(p, new) for p in prompts])

    t0 = time.perf_counter()
    engine.warmup()
    ours = run()
    warmup = time.perf_counter() - t0
    times = time_runs(run, device, args.runs)
    assert len(engine.free) == engine.num_pages, "pages leaked"
    return ours, {"prefill_tokens": budget, "s": statistics.median(times), "runs_s": times, "warmup_s": warmup,
                  "cuda_graphs": engine.cuda_graphs, "graph_errors": engine.graph_errors,
                  "tokens_per_s": batch * new / statistics.median(times), "page_size": args.page_size,
                  "buckets": engine.buckets, "stats": dict(engine.stats)}, engine


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'batch':>5} {'prompt':>6} {'new':>5} {'budget':>7} {'tilegen tok/s':>14} {'HF tok/s':>10} "
          f"{'HF cache':>16} {'x HF':>6} {'match@32':>9} {'match all':>9} {'decode':>7}")
    for r in rows:
        hf = r.get("hf")
        hf_rate = f"{hf['tokens_per_s']:10.1f}" if hf else f"{'-':>10}"
        hf_mode = (hf["cache"] + ("+compile" if hf["torch_compile"] else "")) if hf else "failed"
        speed = f"{r['hf_speedup']:6.2f}" if "hf_speedup" in r else f"{'-':>6}"
        m32 = f"{r['match_first32']:9.3f}" if "match_first32" in r else f"{'-':>9}"
        mall = f"{r['match_all']:9.3f}" if "match_all" in r else f"{'-':>9}"
        ours = r["tilegen"]
        stats = ours["stats"]
        decode = ("graphs" if stats["graph_replays"] == stats["decode_steps"] else "mixed") \
            if stats["graph_replays"] else "eager"
        print(f"{r['batch']:>5} {r['prompt']:>6} {r['new']:>5} {ours['prefill_tokens']:>7} "
              f"{ours['tokens_per_s']:14.1f} {hf_rate} {hf_mode:>16} {speed} {m32} {mall} {decode:>7}")
        for t in r.get("tilegen_budgets", []):
            speed = f"{t['tokens_per_s'] / hf['tokens_per_s']:6.2f}" if hf else f"{'-':>6}"
            same = "same tokens" if t["same_tokens_as_first_budget"] else "other tokens"
            print(f"{'':>17} {t['prefill_tokens']:>7} {t['tokens_per_s']:14.1f} {'':>10} {'':>16} {speed} "
                  f"{same:>19}")
        if "fp8" in r:
            f = r["fp8"]
            print(f"      {f['kv_dtype']} pages: {f['tokens_per_s']:.1f} tok/s, greedy tokens identical to the "
                  f"unquantized cache's: {f['match_first32_vs_unquantized']:.3f} of the first 32, "
                  f"{f['match_all_vs_unquantized']:.3f} of all")
            t = f["teacher_forced"]
            if "skipped" in t:
                print(f"      teacher-forced logits: skipped ({t['skipped']})")
            else:
                print(f"      teacher-forced over {t['steps']} steps x {t['requests']} requests: top-1 agreement "
                      f"{t['top1_agreement']:.4f}, max |logit error| / max |logit| median {t['rel_error_median']:.2e}, "
                      f"worst {t['rel_error_max']:.2e}")
        for e in ours["graph_errors"]:
            print(f"      CUDA graph: {e}")
        for e in r.get("hf_errors", []):
            print(f"      transformers: {e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--batch", default=None, help="comma-separated batch sizes (requests per run); "
                        "default 1,8,64 on a GPU, 1,3 on the CPU")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 2048; CPU 9)")
    parser.add_argument("--new", type=int, default=None, help="tokens generated per request (default 256; CPU 5)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; CPU 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (CPU fp32)")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model's widths (default off a GPU)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; CPU 8)")
    parser.add_argument("--prefill-tokens", default="16384", help="most prompt tokens prefilled per step; several, "
                        "comma-separated, time the engine with each (the first gives the token comparisons)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per provider (median; default 3, CPU 1)")
    parser.add_argument("--hf-cache", choices=("auto", "static", "dynamic"), default="auto",
                        help="transformers' cache: auto tries static (compiled on a GPU), then dynamic")
    parser.add_argument("--no-graphs", action="store_true", help="decode steps eagerly, without CUDA graphs")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                        help="also generate over FP8 pages (scale 1.0) and report their greedy agreement, and, "
                        "teacher-forced on the unquantized cache's tokens, their logits' top-1 agreement and error")
    parser.add_argument("--kv-scale", type=float, default=1.0,
                        help="the FP8 pages' scale (one per tensor; default 1.0, vLLM's when nothing is calibrated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not on_gpu and not interpreting():
        # Triton picks the interpreter when it is imported, which `import tilegen` already did.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env).returncode
    device = torch.device("cuda" if on_gpu else "cpu")
    batches = [int(b) for b in (args.batch or ("1,8,64" if on_gpu else "1,3")).split(",")]
    prompt_len = args.prompt or (2048 if on_gpu else 9)
    new = args.new or (256 if on_gpu else 5)
    layers = args.layers or (4 if on_gpu else 2)
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    args.page_size = args.page_size or (16 if on_gpu else 8)
    args.runs = args.runs or (3 if on_gpu else 1)
    args.prefill_tokens = [int(t) for t in args.prefill_tokens.split(",")]
    if not (0 < args.kv_scale < math.inf):
        raise SystemExit(f"--kv-scale: expected a finite positive number, got {args.kv_scale}")
    if min(batches) < 1 or prompt_len < 1 or new < 1 or layers < 1 or args.runs < 1 or min(args.prefill_tokens) < 1:
        raise SystemExit("--batch, --prompt, --new, --layers, --runs, --prefill-tokens: expected positive numbers")
    dims = TINY if args.tiny or not on_gpu else LLAMA3_8B
    dims = {**dims, "max_position_embeddings": max(dims["max_position_embeddings"], prompt_len + new)}
    model = build_model(dims, layers, dtype, device, args.seed)
    print(f"model: {layers} Llama layers, hidden {dims['hidden_size']}, heads {dims['num_attention_heads']}/"
          f"{dims['num_key_value_heads']}, vocab {dims['vocab_size']}, {dtype}, on "
          f"{torch.cuda.get_device_name() if on_gpu else 'cpu (Triton interpreter)'}", flush=True)
    rows = []
    for batch in batches:
        row = bench_batch(model, batch, prompt_len, new, args, device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    _print_table(rows)
    if args.out:
        import transformers
        import triton

        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if on_gpu else "cpu-interpreter",
                       "torch": torch.__version__, "triton": triton.__version__,
                       "transformers": transformers.__version__, "layers": layers, "dtype": str(dtype),
                       "model": dims, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
