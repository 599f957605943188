"""A tuned row that fails to compile or launch never takes the op down: one warning, then the default."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3

import pytest
import torch
import triton

import tilegen
from tilegen import dispatch
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.device import device_info
from tilegen.families import family_of, registry
from tilegen.families.attention_fwd import AttentionSpec, Config
from tilegen.families.attention_fwd.reference import attention_reference

SPEC = AttentionSpec(head_dim=32, mask="causal", dtype="fp32")


@pytest.fixture
def broken_row(tmp_path, monkeypatch):
    """The user's database holds a row for bucket 64 whose config the kernel cannot compile
    (block_m 48: tl.arange needs a power of two), written behind the writers' checks, with the
    feasibility rule that would otherwise skip it at load time switched off."""
    path = tmp_path / "tuning.sqlite"
    family = family_of(SPEC)
    with TuningDB(path) as db:
        db.record_best(
            spec=SPEC, device=device_info(), template_hash=template_hash(family), triton_version=triton.__version__,
            bucket=64, config=Config(32, 16, 4, 1).to_dict(), time_ms=0.001, max_error=0.0, trials=1,
        )
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tg_tuned_configs SET config_json = ?", (json.dumps(Config(48, 16, 4, 1).to_dict()),))
    monkeypatch.setenv("TILEGEN_DB", str(path))
    # A family is a value: its feasibility rule is switched off by registering a copy without one for the test.
    monkeypatch.setitem(registry._by_name, family.name,
                        dataclasses.replace(family, feasible=lambda spec, config, device: None))
    return path


def _inputs(device):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 50, 32, generator=gen).to(device) for _ in range(3))


def test_a_row_that_fails_to_launch_is_skipped_with_one_warning(broken_row, device, caplog):
    q, k, v = _inputs(device)
    assert tilegen.explain(q, k, v, causal=True).config == Config(48, 16, 4, 1)  # the bad row is what loads
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        out = tilegen.attention(q, k, v, causal=True)
        again = tilegen.attention(q, k, v, causal=True)  # the plan now launches the default directly
        other = tilegen.attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out.double() - ref).abs().max() < 1e-4 and torch.equal(out, again)
    assert other.shape == (1, 2, 40, 32)
    warnings = [r.getMessage() for r in caplog.records if "skipping the tuned config" in r.getMessage()]
    assert len(warnings) == 1 and "BM48-BN16-w4-s1" in warnings[0] and str(broken_row) in warnings[0]
    choice = tilegen.explain(q, k, v, causal=True)
    assert choice.source == "default" and choice.config != Config(48, 16, 4, 1)


def test_the_custom_op_path_falls_back_too(broken_row, device):
    q, k, v = _inputs(device)
    out, _ = torch.ops.tilegen.attention_fwd(q, k, v, 32, "causal", False, False, 32 ** -0.5, 0.0, 1 << 30, 0)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out.double() - ref).abs().max() < 1e-4
    dispatch.reset()
