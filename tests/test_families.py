"""The family registry, shown with a family kept in its own package: examples/row_softmax_family.

It goes through lower, render, tune, store, dispatch and ``tilegen db list/prune`` with no
edit to tilegen. Here it is registered at run time (the one ``register`` line below); the
end-to-end test at the bottom installs it the other way, through its entry point, in fresh
processes that never call ``register``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from row_softmax_family import FAMILY, RowSoftmaxConfig
from row_softmax_family.op import row_softmax
from row_softmax_family.reference import softmax_reference
from row_softmax_family.spec import RowSoftmaxSpec
from typer.testing import CliRunner

import tilegen
from tilegen import dispatch
from tilegen.cli import app
from tilegen.cli.spec_args import presets
from tilegen.codegen import module_for, render, source_for
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families import base
from tilegen.families import (
    families,
    family_of,
    get,
    register,
    registry,
    relative_error,
    spec_from_json,
)
from tilegen.ir import SpecError
from tilegen.key import TuningKey
from tilegen.tuning import Tuner

register(FAMILY)  # the one line that adds the family at run time

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "row_softmax_family"

SPEC = RowSoftmaxSpec(dtype="fp32")
DEVICE = device_info()  # the interpreter without a GPU


# ------------------------------------------------------------------------------ registry

def test_the_registry_finds_the_family_by_spec_name_and_json():
    assert family_of(SPEC) is get("row_softmax") is FAMILY
    assert families()[0].name == "attention_fwd" and "row_softmax" in [f.name for f in families()]
    back = spec_from_json(SPEC.to_json())
    assert type(back) is RowSoftmaxSpec and back == SPEC and back.hash == SPEC.hash
    assert json.loads(SPEC.to_json()) == {"family": "row_softmax", "ir_version": 1, "dtype": "fp32"}


def test_registering_again_is_a_no_op_and_a_rival_is_refused():
    copy = pickle.loads(pickle.dumps(FAMILY))  # what the tuning worker receives with each trial
    assert copy is not FAMILY and copy == FAMILY and hash(copy) == hash(FAMILY) and repr(copy) == "<kernel family row_softmax>"
    assert register(copy) is FAMILY
    rival = dataclasses.replace(FAMILY, default_rule=lambda spec, device: [(None, RowSoftmaxConfig(1, 1))])
    with pytest.raises(ValueError, match="'row_softmax' is already registered"):
        register(rival)


def test_a_family_refuses_parts_that_do_not_fit_naming_the_field():
    with pytest.raises(ValueError, match="spec_type: RowSoftmaxSpec.family is 'row_softmax', not .* 'softmax'"):
        dataclasses.replace(FAMILY, name="softmax")
    with pytest.raises(TypeError, match="problem_type: expected a subclass of Problem"):
        dataclasses.replace(FAMILY, problem_type=RowSoftmaxConfig)
    with pytest.raises(TypeError, match="family: expected a tilegen.families.Family"):
        register("row_softmax_family:FAMILY")


@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_has_configs_to_tune_on_the_cpu_and_on_hopper(name):
    # Each knob of a family's config needs a value in each search space: one left out of the interpreter's made
    # every CPU tune of the family fail before its first trial.
    spec = presets()[name]
    for device in (CPU_INTERPRETER, DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)):
        assert family_of(spec).candidates(spec, device), device.name


def test_default_tune_sizes_are_the_family_s_own():
    assert FAMILY.buckets.tune_sizes(on_gpu=True) == (256, 1024, 4096, 16384)
    assert FAMILY.buckets.tune_sizes(on_gpu=False) == (16, 64) and FAMILY.buckets.tune_batches(on_gpu=False) == ()
    decode = get("attention_decode").buckets
    assert decode.tune_sizes(on_gpu=True) == (1024, 4096, 16384, 65536) and decode.tune_batches(on_gpu=True) == (1, 8, 64)


def test_unknown_family_names_the_known_ones():
    with pytest.raises(SpecError, match="unknown kernel family 'nope'.*'attention_fwd'.*'row_softmax'"):
        spec_from_json({"family": "nope", "dtype": "fp32"})


def test_canonical_json_leaves_out_defaults_so_new_fields_keep_old_hashes():
    # ``log`` holds its default: it is absent, as a field added in a later release would be.
    assert "log" not in json.loads(SPEC.to_json())
    assert "log" in json.loads(SPEC.replace(log=True).to_json())
    assert SPEC.replace(log=True).hash != SPEC.hash


def test_configs_differing_in_one_knob_have_distinct_identities():
    a, b = RowSoftmaxConfig(2, 1), RowSoftmaxConfig(2, 4)
    assert a.to_json() != b.to_json() and str(a) != str(b)
    assert RowSoftmaxConfig.from_dict(json.loads(a.to_json())) == a


# ------------------------------------------------------------------------- lower and render

def test_the_family_renders_from_its_own_folder_with_a_shared_piece():
    source = source_for(SPEC.replace(log=True))
    assert source.startswith("# Generated by tilegen") and SPEC.replace(log=True).to_json() in source
    assert "tl.log(b_sum)" in source and "tl.log(b_sum)" not in source_for(SPEC)
    closure = render.template_closure(FAMILY)
    assert list(closure) == ["row_softmax.py.jinja", "common/header.py.jinja"]
    assert render.template_hash(FAMILY) != render.template_hash(get("attention_fwd"))
    assert callable(module_for(SPEC).launch)


# --------------------------------------------------------------------------------- the op

def test_the_op_names_a_tensor_its_kernels_cannot_reach(monkeypatch):
    """A CPU tensor where kernels run on CUDA (no interpreter): the op says so, not Triton's pointer error."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x: tensors are on the CPU"):
        row_softmax(torch.randn(3, 23))


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log-softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (3, 257), (2, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_op_matches_its_reference(shape, dtype, log, device):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(device=device, dtype=dtype)
    out = row_softmax(x, log=log)
    assert torch.isfinite(out).all()
    error, _ = relative_error(out, softmax_reference(x, log=log))  # inf on any NaN
    assert error < (1e-4 if dtype == torch.float32 else 1e-2)


def test_the_problem_poisons_its_outputs_and_checks_them():
    problem = FAMILY.problem(SPEC, 64, on_gpu=not DEVICE.is_interpreter)
    x = problem.inputs(seed=0)
    outputs = problem.outputs(x)
    assert torch.isnan(outputs[0]).all()
    assert problem.check(x, outputs) == (math.inf, math.inf)  # an unwritten output never passes
    problem.launch(module_for(SPEC), FAMILY.default_config(SPEC, DEVICE, 64), x, outputs)
    error, _ = problem.check(x, outputs)
    assert error < problem.tolerance


# ------------------------------------------------------------ tune, store, dispatch, db CLI

@pytest.fixture
def tuned_db(tmp_path, monkeypatch):
    """A database the family was tuned into, in a real tuning worker, at the bucket of 40 columns."""
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, DEVICE, trials=3) as tuner:
        result = tuner.tune(SPEC, FAMILY.buckets.of(40))
    assert result.best is not None and result.statuses["ok"] == 3
    return path, result


def test_tuned_rows_reach_dispatch_and_the_op(tuned_db, device):
    path, result = tuned_db
    rows = tuned_rows(**TuningKey.current(SPEC, DEVICE).variant_fields())
    assert rows == {64: (result.best.config, str(path))}
    dispatch.reset()
    choice = dispatch.table_for(SPEC, DEVICE).choose(40)
    assert (choice.config, choice.source, choice.bucket) == (result.best.config, str(path), 64)
    x = torch.randn(3, 40, device=device)
    torch.testing.assert_close(row_softmax(x), torch.softmax(x, -1))


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_db_list_shows_the_rows_with_the_family_s_config_label(tuned_db):
    path, result = tuned_db
    listed = _invoke("db", "--db", path, "list")
    assert listed.exit_code == 0, listed.output
    assert "row_softmax_fp32" in listed.stdout and str(result.best.config) in listed.stdout


def _count(path, table):
    with sqlite3.connect(path) as conn:
        return conn.execute(f"select count(*) from {table}").fetchone()[0]


def test_prune_keeps_current_rows_of_every_family_and_unknown_ones_unless_all(tuned_db, monkeypatch):
    path, _ = tuned_db
    pruned = _invoke("db", "--db", path, "prune", "--yes")
    assert pruned.exit_code == 0 and "nothing matched" in pruned.stderr
    assert _count(path, "tg_tuned_configs") == 1

    # A tilegen that does not know the family (an older release reading a newer one's rows).
    monkeypatch.delitem(registry._by_name, "row_softmax")
    kept = _invoke("db", "--db", path, "prune", "--yes").stderr
    assert "nothing matched: 1 tuned config(s) and 3 trial(s)" in kept and "kept (--all deletes them)" in kept
    assert _count(path, "tg_tuned_configs") == 1
    listed = _invoke("db", "--db", path, "list")  # shown with the raw config, not an error
    assert listed.exit_code == 0 and '"block_rows"' in listed.stdout
    pruned = _invoke("db", "--db", path, "prune", "--all", "--yes")
    assert pruned.exit_code == 0 and "pruned 4 rows" in pruned.stderr  # the tuned row and its 3 trials
    assert _count(path, "tg_tuned_configs") == 0 and _count(path, "tg_trials") == 0


def test_prune_drops_rows_of_an_edited_template(tuned_db, monkeypatch):
    path, _ = tuned_db
    from tilegen.db import store

    monkeypatch.setattr(store, "current_template_hash", lambda family: "0" * 16)
    assert "pruned 4 rows" in _invoke("db", "--db", path, "prune", "--yes").stderr


def test_tune_command_takes_the_family_s_spec(tmp_path):
    db = tmp_path / "cli.sqlite"
    result = _invoke("tune", "--db", db, "--spec", SPEC.to_json(), "--sizes", "20", "--trials", "2")
    assert result.exit_code == 0, result.output
    with TuningDB(db) as opened:
        (row,) = opened.list_tuned()
    assert (row.family, row.bucket, row.variant_name) == ("row_softmax", 32, "row_softmax_fp32")


def test_emit_tuned_says_the_family_has_no_standalone_entry_point():
    result = _invoke("emit", "--tuned", "--spec", SPEC.to_json())
    assert result.exit_code == 2 and "no standalone entry point" in result.stderr
    assert tilegen.__version__ in _invoke("emit", "--spec", SPEC.to_json()).stdout


# ------------------------------------------------------------------- through an entry point

def _installed(folder: Path, **points: str) -> Path:
    """``folder`` as a site-packages that holds the example's metadata (what ``pip install`` of
    examples/row_softmax_family writes), declaring ``points`` in group ``tilegen.families``."""
    info = folder / "row_softmax_family-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: row_softmax_family\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in points.items())
    (info / "entry_points.txt").write_text(f"[tilegen.families]\n{lines}")
    return folder


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as a process starts it: tilegen's own families, entry points not yet read."""
    monkeypatch.setattr(registry, "_by_name", {f.name: f for f in families() if f.name != "row_softmax"})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)


def test_entry_points_load_once_on_a_miss_and_a_broken_one_is_one_warning(tmp_path, fresh_registry, monkeypatch,
                                                                         caplog):
    monkeypatch.syspath_prepend(str(_installed(tmp_path, row_softmax="row_softmax_family:FAMILY",
                                               broken="row_softmax_family:NOTHING")))
    assert get("attention_fwd").name == "attention_fwd" and not registry._entry_points_loaded  # a hit reads none
    with caplog.at_level(logging.WARNING, logger="tilegen.families"):
        assert family_of(SPEC) is FAMILY
        assert [f.name for f in families()][-1] == "row_softmax"  # loaded once: no second warning
        with pytest.raises(SpecError, match="unknown kernel family 'nope'"):
            get("nope")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "entry point 'broken' (row_softmax_family:NOTHING) of group 'tilegen.families'" in warning


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow
def test_an_installed_family_tunes_lists_shows_verifies_emits_and_dispatches_with_no_register_call(tmp_path):
    site = _installed(tmp_path / "site", row_softmax="row_softmax_family:FAMILY")
    db = tmp_path / "tuning.sqlite"
    # Paths already on PYTHONPATH (packages installed there) stay after the family's.
    path = [str(site), str(EXAMPLE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TILEGEN_DB": str(db)}
    spec = SPEC.to_json()
    tuned = _run("-m", "tilegen", "tune", "--spec", spec, "--sizes", "40", "--trials", "2", env=env)
    assert "stored in" in tuned.stderr
    # The family's label for its config (a family tilegen did not know would show the raw JSON).
    listed = _run("-m", "tilegen", "db", "list", env=env).stdout
    assert "row_softmax_fp32" in listed and "block_rows" in listed and '"block_rows"' not in listed
    shown = _run("-m", "tilegen", "db", "show", SPEC.hash, env=env).stdout
    assert "row_softmax_fp32" in shown and "block_rows" in shown
    verified = _run("-m", "tilegen", "db", "verify", env=env)
    assert "row_softmax_fp32" in verified.stdout + verified.stderr
    assert SPEC.to_json() in _run("-m", "tilegen", "emit", "--spec", spec, env=env).stdout
    script = (
        "import torch\n"
        "from row_softmax_family.op import row_softmax\n"
        "from row_softmax_family.spec import RowSoftmaxSpec\n"
        "from tilegen import dispatch\n"
        "from tilegen.device import device_info\n"
        "choice = dispatch.table_for(RowSoftmaxSpec(dtype='fp32'), device_info()).choose(40)\n"
        f"assert (choice.bucket, choice.source) == (64, {str(db)!r}), choice\n"
        "x = torch.randn(3, 40, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
        "torch.testing.assert_close(row_softmax(x), torch.softmax(x, -1))\n"
        "print('ok')\n"
    )
    assert _run("-c", script, env=env).stdout == "ok\n"


@pytest.mark.parametrize("row, value", [(0, math.inf), (0, 3.0), (1, -math.inf), (1, math.nan), (2, math.inf)])
def test_lse_error_holds_rows_without_keys_to_minus_inf(row, value):
    """Every family's tuning check reads an LSE through base.lse_error: a row that sees no key is -inf in the
    reference, and only -inf there passes (+inf, or a finite value, would once have slipped through a check of
    isfinite); NaN or +inf anywhere fails."""
    ref = torch.tensor([[-math.inf, -math.inf], [1.5, -0.25], [2.0, 4.0]], dtype=torch.float64)
    assert base.lse_error(ref.float(), ref) == (0.0, 0.0)
    got = ref.float().clone()
    got[row, 0] = value
    assert base.lse_error(got, ref)[0] == math.inf
    near = ref.float().clone()
    near[2, 1] = 4.0 + 1e-3
    assert 0 < base.lse_error(near, ref)[0] < 1e-3
