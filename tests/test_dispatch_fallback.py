"""A tuned row that fails to compile or launch never takes an op down: one warning, then the default.

Every op launches through ``tilegen.dispatch.planned``, so each family gets the same check: the
user's database holds a row whose config the kernel cannot compile (a block that is no power of
two: ``tl.arange`` refuses it), written behind the writers' checks, with the family's feasibility
rule, which would otherwise skip it at load time, switched off. The op must give the float64
reference's answer, warn once naming the row, and choose the default from then on.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import triton
from test_kv_append import make_batch
from test_varlen import make_cache, paged_reference

import tilegen
from tilegen import dispatch
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.device import device_info
from tilegen.families import family_of, registry, relative_error
from tilegen.families.attention_decode import DecodeSpec
from tilegen.families.attention_decode.config import DecodeConfig, split_count
from tilegen.families.attention_fwd import AttentionSpec, Config
from tilegen.families.attention_varlen.config import VarlenConfig
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_varlen import VarlenAttentionSpec
from tilegen.families.attention_varlen.reference import varlen_reference
from tilegen.families.blockwise_ffn import BlockwiseFFNSpec
from tilegen.families.blockwise_ffn import Config as FFNConfig
from tilegen.families.blockwise_ffn.problem import random_weights
from tilegen.families.blockwise_ffn.reference import ffn_reference
from tilegen.families.kv_append import KVAppendSpec
from tilegen.families.kv_append.config import Config as AppendConfig
from tilegen.families.kv_append.problem import check_pages
from tilegen.families.merge_states import MergeStatesSpec
from tilegen.families.merge_states.config import Config as MergeConfig
from tilegen.families.merge_states.problem import random_lse
from tilegen.families.merge_states.reference import merge_reference
from tilegen.families.rope import RopeSpec
from tilegen.families.rope.config import Config as RopeConfig
from tilegen.families.rope.reference import rope_reference, rope_tables
from tilegen.layers import LayerConfig, reference_layer
from tilegen.layers.family import Config as LayerBlock
from tilegen.layers.family.problem import random_weights as random_layer_weights
from tilegen.layers.op import explain_layer, layer_spec
from tilegen.ops.append import explain_append
from tilegen.ops.merge import explain_merge
from tilegen.ops.rope import explain_rope

SPEC = AttentionSpec(head_dim=32, mask="causal", dtype="fp32")
BAD = Config(48, 16, 4, 1)


def poison(path, monkeypatch, spec, size, bad) -> None:
    """Store ``bad`` as the tuned row of ``size``'s bucket in a user database at ``path``, behind the
    writers' checks, and let the family's feasibility rule pass it."""
    family = family_of(spec)
    bucket = family.buckets.of(size)
    with TuningDB(path) as db:
        db.record_best(
            spec=spec, device=device_info(), template_hash=template_hash(family), triton_version=triton.__version__,
            bucket=bucket, config=family.default_config(spec, device_info(), bucket).to_dict(), time_ms=0.001,
            max_error=0.0, trials=1,
        )
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tg_tuned_configs SET config_json = ?", (json.dumps(bad.to_dict()),))
    monkeypatch.setenv("TILEGEN_DB", str(path))
    # A family is a value: its feasibility rule is switched off by registering a copy without one for the test.
    monkeypatch.setitem(registry._by_name, family.name,
                        dataclasses.replace(family, feasible=lambda spec, config, device: None))


def skip_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipping the tuned config" in r.getMessage()]


@dataclass
class Poisoned:
    """One op with a bad row: ``run()`` calls the op and returns its outputs' relative errors against
    the float64 reference; ``explain()`` is the op's choice for the call."""

    spec: Any
    size: int | tuple[int, int]  # what the op buckets the call by
    bad: Any
    run: Callable[[], list[float]]
    explain: Callable[[], dispatch.Choice]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(gen, *shape, device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device)


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def dense(device) -> Poisoned:
    gen = _gen()
    q, k, v = (_randn(gen, 1, 2, 50, 32, device=device) for _ in range(3))

    def run():
        out = tilegen.attention(q, k, v, causal=True)
        return [relative_error(out, attention_reference(q, k, v, causal=True)[0])[0]]

    return Poisoned(SPEC, 50, BAD, run, lambda: tilegen.explain(q, k, v, causal=True))


def dense_decode_route(device) -> Poisoned:
    """Two query rows: the dense op runs the decode family's kernel, with that family's table."""
    gen = _gen()
    q, k, v = _randn(gen, 1, 4, 2, 32, device=device), _randn(gen, 1, 2, 50, 32, device=device), \
        _randn(gen, 1, 2, 50, 32, device=device)
    spec = DecodeSpec(head_dim=32, q_per_kv=2, mask="causal", dtype="fp32", kv_layout="dense", q_tokens=2)

    def run():
        out = tilegen.attention(q, k, v, causal=True)
        return [relative_error(out, attention_reference(q, k, v, causal=True)[0])[0]]

    return Poisoned(spec, (50, 1), DecodeConfig(48, 4, 1, 1), run, lambda: tilegen.explain(q, k, v, causal=True))


def varlen(device) -> Poisoned:
    gen = _gen()
    q_lens, k_lens = [17, 0, 5], [17, 3, 9]
    q = _randn(gen, sum(q_lens), 2, 32, device=device)
    k, v = (_randn(gen, sum(k_lens), 2, 32, device=device) for _ in range(2))
    cu_q, cu_k = _cu(q_lens, device), _cu(k_lens, device)
    spec = VarlenAttentionSpec(head_dim=32, q_per_kv=1, mask="causal", dtype="fp32", kv_layout="ragged")

    def run():
        out = tilegen.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, causal=True)
        spans = list(itertools.pairwise(cu_k.tolist()))
        ref, _ = varlen_reference(q, [k[a:b] for a, b in spans], [v[a:b] for a, b in spans], cu_q.cpu(), causal=True)
        return [relative_error(out, ref)[0]]

    return Poisoned(spec, 17, VarlenConfig(48, 16, 4, 1), run, lambda: dispatch.table_on(spec, q.device).choose(17))


def paged_prefill(device) -> Poisoned:
    gen = _gen()
    cache = make_cache([50, 17], 16, 1, 32, torch.float32, device, gen)
    q_lens = [5, 17]
    q = _randn(gen, sum(q_lens), 2, 32, device=device)
    cu_q = _cu(q_lens, device)
    spec = VarlenAttentionSpec(head_dim=32, q_per_kv=2, mask="causal", dtype="fp32", kv_layout="paged", page_size=16)
    attn = tilegen.PagedAttention()

    def run():
        attn.plan(cu_q, cache, heads_q=2, causal=True, max_seqlen_q=17, max_seqlen_k=50)
        errors = []
        for _ in range(2):  # the plan's second run replays what the first settled on
            out = attn.run(q, cache)
            errors.append(relative_error(out.cpu(), paged_reference(q, cache, cu_q, causal=True)[0])[0])
        return errors

    return Poisoned(spec, 50, VarlenConfig(48, 16, 4, 1), run, lambda: dispatch.table_on(spec, q.device).choose(50))


def paged_decode(device, monkeypatch) -> Poisoned:
    """The bad row plans fewer splits than the default (one and four under the interpreter): the plan made
    again for the default brings its own split partials, which the first run launches with in place of the
    bad plan's."""
    gen = _gen()
    cache = make_cache([50], 16, 1, 32, torch.float32, device, gen)
    q = _randn(gen, 1, 2, 32, device=device)
    spec = DecodeSpec(head_dim=32, q_per_kv=2, dtype="fp32", page_size=16)
    monkeypatch.setattr(type(family_of(spec)), "default_config", lambda self, spec, device, bucket: DecodeConfig(
        16, 4, 1, 4))
    decode = tilegen.PagedDecode()
    # How many splits each config makes depends on the device's SMs; what the test needs is that they differ.
    info = device_info()
    bad_splits, splits = (split_count(c, info, 1, 1, 50) for c in (DecodeConfig(48, 4, 1, 1), DecodeConfig(16, 4, 1, 4)))
    assert bad_splits != splits

    def run():
        if decode.plan(cache, heads_q=2).config == DecodeConfig(48, 4, 1, 1):
            assert decode.num_splits == bad_splits
        ref, _ = paged_reference(q, cache, torch.arange(2, dtype=torch.int32))
        errors = [relative_error(decode.run(q, cache).cpu(), ref)[0] for _ in range(2)]
        assert decode.num_splits == splits and decode._plan.part_o.shape[1] == splits
        return errors

    return Poisoned(spec, (50, 1), DecodeConfig(48, 4, 1, 1), run,
                    lambda: dispatch.table_for(spec, device_info()).choose((50, 1)))


def rope(device) -> Poisoned:
    gen = _gen()
    x = _randn(gen, 17, 3, 16, device=device)
    cos, sin = (t.to(device) for t in rope_tables(torch.randint(0, 1 << 17, (17,), generator=gen), 16, theta=1e4))

    def run():
        return [relative_error(tilegen.apply_rope(x, cos, sin), rope_reference(x, cos, sin))[0] for _ in range(2)]

    return Poisoned(RopeSpec(head_dim=16, dtype="fp32"), 51, RopeConfig(3, 1), run, lambda: explain_rope(x, cos, sin))


def merge(device) -> Poisoned:
    gen = _gen()
    o_a, o_b = _randn(gen, 17, 3, 16, device=device), _randn(gen, 17, 3, 16, device=device)
    lse_a, lse_b = (t.to(device) for t in random_lse((17, 3), gen))

    def run():
        errors = []
        for _ in range(2):
            o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
            ref, ref_lse = merge_reference(o_a.cpu(), lse_a.cpu(), o_b.cpu(), lse_b.cpu())
            seen = torch.isfinite(ref_lse)
            assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
            errors += [relative_error(o.cpu(), ref)[0], relative_error(lse.cpu()[seen], ref_lse[seen])[0]]
        return errors

    return Poisoned(MergeStatesSpec(head_dim=16, dtype="fp32"), 51, MergeConfig(3, 1), run,
                    lambda: explain_merge(o_a, lse_a, o_b, lse_b))


def append(device) -> Poisoned:
    cache, k, v, cu = make_batch([5, 0, 17], [2, 3, 4], page_size=16, device=device)
    spec = KVAppendSpec(head_dim=40, head_dim_v=40, page_size=16, dtype="fp32")

    def run():
        tilegen.append_kv(cache, k, v, cu)
        # A copy: every target slot exact, every other slot still NaN (inf otherwise).
        return list(check_pages(cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len,
                                k, v, cu))

    return Poisoned(spec, 9, AppendConfig(3, 1, 1), run, lambda: explain_append(cache, k, v, cu))


def ffn(device) -> Poisoned:
    spec = BlockwiseFFNSpec(d_model=40, d_ffn=72, dtype="fp32")
    w = random_weights(spec, _gen(), device, torch.float32)
    x = _randn(torch.Generator().manual_seed(1), 17, 40, device=device)
    weights = {"w_norm": w.w_norm, "w_gate": w.w_gate, "w_up": w.w_up, "w_down": w.w_down}

    def run():
        ref = ffn_reference(x, w.w_norm, None, w.w_gate, w.w_up, w.w_down, norm="rmsnorm", ffn="swiglu", eps=1e-5)
        return [relative_error(tilegen.blockwise_ffn(x, **weights), ref)[0] for _ in range(2)]

    return Poisoned(spec, 17, FFNConfig(64, 48, 32, 32, 16, 4, 1), run,
                    lambda: dispatch.table_on(spec, x.device).choose(17))


FAMILIES = {"attention-dense": dense, "attention-decode-route": dense_decode_route, "varlen": varlen,
            "paged-prefill": paged_prefill, "paged-decode": paged_decode, "rope": rope, "merge-states": merge,
            "append-kv": append, "blockwise-ffn": ffn}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_row_that_fails_to_launch_is_skipped_with_one_warning(name, tmp_path, monkeypatch, caplog, device):
    make = FAMILIES[name]
    case = make(device, monkeypatch) if name == "paged-decode" else make(device)
    path = tmp_path / "tuning.sqlite"
    poison(path, monkeypatch, case.spec, case.size, case.bad)
    first = case.explain()
    assert (first.config, first.source) == (case.bad, str(path))  # the bad row is what loads
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        errors = case.run()
        errors += case.run()  # replayed, or planned afresh without the row: no second warning
    assert max(errors) < 1e-4, errors
    warnings = skip_warnings(caplog)
    assert len(warnings) == 1 and str(case.bad) in warnings[0] and str(path) in warnings[0], warnings
    choice = case.explain()
    assert choice.source == "default" and choice.tuned_bucket is None and choice.config != case.bad


def test_the_custom_op_path_falls_back_too(tmp_path, monkeypatch, caplog, device):
    q, k, v = (_randn(_gen(), 1, 2, 50, 32, device=device) for _ in range(3))
    poison(tmp_path / "tuning.sqlite", monkeypatch, SPEC, 50, BAD)
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        out, _ = torch.ops.tilegen.attention_fwd(q, k, v, 32, "causal", False, False, 32 ** -0.5, 0.0, 1 << 30, 0)
    assert relative_error(out, attention_reference(q, k, v, causal=True)[0])[0] < 1e-4
    assert len(skip_warnings(caplog)) == 1


def test_a_decode_sized_call_never_loads_the_dense_table(device):
    gen = _gen()
    tilegen.attention(_randn(gen, 1, 4, 2, 32, device=device), _randn(gen, 1, 2, 50, 32, device=device),
                      _randn(gen, 1, 2, 50, 32, device=device), causal=True)
    loaded = [spec for spec, _ in dispatch._tables]
    assert loaded and all(isinstance(spec, DecodeSpec) for spec in loaded), loaded


LAYER = LayerConfig(d_model=32, heads_q=4, heads_kv=2, head_dim=16, d_ffn=48, causal=True)


@pytest.fixture
def failing_block(tmp_path, monkeypatch):
    """A tuned query block of 8 for the blockwise layer that fails part way (out of memory, say: a
    positive block always compiles), after spoiling the output it was writing."""
    spec = layer_spec(LAYER, torch.float32)
    poison(tmp_path / "tuning.sqlite", monkeypatch, spec, 21, LayerBlock(8))
    launcher = dispatch.launcher_for(spec)
    launch = launcher.direct

    def direct(x, w, out, **kwargs):
        if kwargs["block_q"] == 8:
            out[: len(out) // 2].fill_(math.nan)
            raise torch.OutOfMemoryError("a block of 8 does not fit")
        return launch(x, w, out, **kwargs)

    monkeypatch.setattr(launcher, "direct", direct)
    return tmp_path / "tuning.sqlite"


def test_the_layer_falls_back_into_a_buffer_of_its_own(failing_block, caplog, device):
    weights = random_layer_weights(LAYER, _gen(), device, torch.float32)
    x = _randn(torch.Generator().manual_seed(1), 2, 21, 32, device=device)  # two sequences: one plan, one fallback
    assert explain_layer(x, weights, LAYER).config == LayerBlock(8)
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        out = tilegen.blockwise_layer(x, weights, LAYER)
    ref = reference_layer(x, weights, LAYER, compute_dtype=torch.float64)
    assert relative_error(out, ref)[0] < 1e-4
    warnings = skip_warnings(caplog)
    assert len(warnings) == 1 and "block_q8" in warnings[0] and str(failing_block) in warnings[0], warnings
    choice = explain_layer(x, weights, LAYER)
    assert choice.source == "default" and choice.config != LayerBlock(8)


def test_the_layer_in_place_raises_rather_than_run_over_rows_it_overwrote(failing_block, caplog, device):
    weights = random_layer_weights(LAYER, _gen(), device, torch.float32)
    x = _randn(torch.Generator().manual_seed(1), 21, 32, device=device)
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"), pytest.raises(torch.OutOfMemoryError):
        tilegen.blockwise_layer(x, weights, LAYER, out=x)
    assert not skip_warnings(caplog)
    assert explain_layer(x, weights, LAYER).config == LayerBlock(8)  # not skipped: it was never run again
