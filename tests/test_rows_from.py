"""A training forward (the spec that also writes the LSE) served the rows tuned without it (``Family.rows_from``).

Presets and inference tune attention without the LSE; a call that trains asks for it, and before it had no
rows at all. Per bucket its own row wins; a bucket it has none for takes the LSE-free spec's row, where the
family's ``feasible`` takes that config for it, and ``explain`` and ``emit --tuned`` say whose row it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

import tilegen
from tilegen import AttentionSpec, dispatch, env
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import CPU_INTERPRETER, device_info
from tilegen.families import family_of
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_varlen import FAMILY as ATTENTION_VARLEN
from tilegen.families.attention_varlen import VarlenAttentionSpec

INFERENCE = AttentionSpec(head_dim=32, mask="causal", dtype="fp32")
TRAINING = INFERENCE.replace(return_lse=True)


@pytest.fixture
def files(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the user's database, the shipped one), both empty, in place of the real ones."""
    user, shipped = tmp_path / "user.sqlite", tmp_path / "shipped.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(user))
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    dispatch.reset()
    yield user, shipped
    dispatch.reset()


def store(path: Path, spec, bucket: int, config, *, version: str | None = None, on=CPU_INTERPRETER) -> None:
    with TuningDB(path) as db:
        db.record_best(spec=spec, device=on, template_hash=template_hash(family_of(spec)),
                       triton_version=version or triton.__version__, bucket=bucket, config=config.to_dict(),
                       time_ms=1.0, max_error=1e-5, trials=3)


def rows_of(spec):
    return tuned_rows(spec, CPU_INTERPRETER, template_hash(family_of(spec)), triton.__version__)


def test_the_lse_spec_takes_the_rows_tuned_without_it_where_it_has_none(files):
    user, shipped = files
    store(shipped, INFERENCE, 64, Config(32, 16, 4, 1))
    store(shipped, INFERENCE, 128, Config(16, 16, 4, 1))
    store(user, TRAINING, 128, Config(32, 32, 4, 1))  # its own row wins its bucket
    rows = rows_of(TRAINING)
    assert rows == {64: (Config(32, 16, 4, 1), str(shipped)), 128: (Config(32, 32, 4, 1), str(user))}
    assert rows.tuned_for == {64: INFERENCE.name}
    table = dispatch.Table(TRAINING, CPU_INTERPRETER, rows)
    assert table.choose(50).note == f"tuned for {INFERENCE.name}" and table.choose(100).note is None
    # The spec without the LSE takes nothing from the one with it.
    assert rows_of(INFERENCE) == {64: (Config(32, 16, 4, 1), str(shipped)), 128: (Config(16, 16, 4, 1), str(shipped))}
    assert rows_of(INFERENCE).tuned_for == {}


def test_a_row_of_another_triton_keeps_saying_so(files, monkeypatch):
    _, shipped = files
    store(shipped, INFERENCE, 64, Config(32, 16, 4, 1), version="3.0.0")
    rows = rows_of(TRAINING)
    assert rows.tuned_for == {64: INFERENCE.name} and rows.tuned_under == {64: "3.0.0"}
    choice = dispatch.Table(TRAINING, CPU_INTERPRETER, rows).choose(64)
    assert choice.note == f"tuned for {INFERENCE.name}; tuned under Triton 3.0.0; installed {triton.__version__}"


def test_a_config_feasible_refuses_for_the_lse_spec_is_not_taken(files, monkeypatch):
    from tilegen.families import registry

    _, shipped = files
    store(shipped, INFERENCE, 64, Config(32, 16, 4, 1))
    store(shipped, INFERENCE, 128, Config(16, 16, 4, 1))
    feasible = ATTENTION_FWD.feasible

    def no_lse_at_m32(spec, config, device):
        if spec.return_lse and config.block_m == 32:
            return "block_m=32: refused with the LSE"
        return feasible(spec, config, device)

    monkeypatch.setitem(registry._by_name, ATTENTION_FWD.name,
                        __import__("dataclasses").replace(ATTENTION_FWD, feasible=no_lse_at_m32))
    rows = rows_of(TRAINING)
    assert rows == {128: (Config(16, 16, 4, 1), str(shipped))} and rows.tuned_for == {128: INFERENCE.name}


def test_a_training_call_runs_the_row_tuned_without_the_lse(files, device):
    _, shipped = files
    store(shipped, INFERENCE, 64, Config(32, 16, 4, 1), on=device_info())
    q, k, v = (torch.randn(1, 2, 37, 32, device=device, requires_grad=True) for _ in range(3))
    choice = tilegen.explain(q, k, v, causal=True)
    assert (choice.config, choice.source, choice.tuned_for) == (Config(32, 16, 4, 1), str(shipped), INFERENCE.name)
    out = tilegen.attention(q, k, v, causal=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, causal=True)[0]
    ref.backward(grad.cpu().double())
    for got, want in ((out, ref), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.isfinite(got).all()
        assert float((got.detach().cpu().double() - want.detach()).norm() / want.detach().norm()) < 1e-4
    # Inference without grad runs the same row, for the spec it was tuned for.
    with torch.no_grad():
        assert tilegen.explain(q, k, v, causal=True).tuned_for is None


def test_the_ragged_family_serves_its_lse_spec_alike(files):
    _, shipped = files
    inference = VarlenAttentionSpec(head_dim=32, mask="causal", dtype="fp32")
    config = ATTENTION_VARLEN.default_config(inference, CPU_INTERPRETER, 64)
    store(shipped, inference, 64, config)
    rows = rows_of(inference.replace(return_lse=True))
    assert rows == {64: (config, str(shipped))} and rows.tuned_for == {64: inference.name}


def test_emit_tuned_says_whose_row_it_serves(files, monkeypatch):
    from tilegen.cli.emit import standalone_entry_point

    _, shipped = files
    store(shipped, INFERENCE, 64, Config(32, 16, 4, 1), on=device_info())  # emit serves the device it runs on
    source = standalone_entry_point(TRAINING)
    assert f"{shipped} (tuned for {INFERENCE.name})" in source


def test_a_ragged_backward_is_told_to_tune_the_dense_spec_whose_rows_serve_it():
    """The tuner measures dense backward batches only: the command a ragged backward without rows is given tunes the
    dense spec (``rows_from``), which the tuner takes; a spec the tuner measures keeps its own."""
    from tilegen.families.attention_bwd import AttentionBwdSpec

    dense = AttentionBwdSpec(head_dim=32, mask="causal", dtype="fp32")
    ragged = dense.replace(layout="ragged")
    with pytest.raises(NotImplementedError, match="dense spec's tuned rows"):
        family_of(ragged).problem_type.for_bucket(ragged, 64, on_gpu=False)
    assert dispatch.tune_command(ragged, 64) == dispatch.tune_command(dense, 64)
    assert f"'{dense.to_json()}'" in dispatch.tune_command(dense, 64)
    assert '"return_lse":true' in dispatch.tune_command(TRAINING, 64)
