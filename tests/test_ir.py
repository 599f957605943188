"""The IR: canonical JSON, its hash, and validation that names the bad field."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from tilegen import ir
from tilegen import AttentionSpec, SpecError, spec_from_json

SPECS = [
    AttentionSpec(head_dim=64),
    AttentionSpec(head_dim=128, q_per_kv=8, mask="causal", dtype="fp16"),
    AttentionSpec(head_dim=96, head_dim_v=32, mask="window", softcap=True, dtype="fp32", return_lse=True),
    AttentionSpec(head_dim=40, kv_layout="paged"),
    AttentionSpec(head_dim=256, head_dim_v=16, q_per_kv=3, kv_layout="ragged", return_lse=True),
]
SPEC_IDS = [s.name for s in SPECS]


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_json_round_trip(spec):
    text = spec.to_json()
    back = spec_from_json(text)
    assert back == spec
    assert back.to_json() == text
    assert back.hash == spec.hash
    assert spec_from_json(json.loads(text)) == spec  # a parsed dict is accepted too


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_json_is_canonical(spec):
    text = spec.to_json()
    data = json.loads(text)
    assert text == json.dumps(data, sort_keys=True, separators=(",", ":"))  # sorted keys, no whitespace
    assert data["family"] == "attention_fwd"
    assert data["ir_version"] == ir.IR_VERSION
    # Fields added after IR version 1 (the mods) are left out at their default, so no existing hash moves.
    assert set(data) == {"family", "ir_version"} | {f.name for f in dataclasses.fields(AttentionSpec)} - {
        "score_mod", "mask_mod"}


def test_equal_specs_spelled_differently_are_one_spec():
    spelled = '{ "mask": "causal",\n  "head_dim": 128, "q_per_kv": 4, "dtype": "bf16", "family": "attention_fwd" }'
    canonical = AttentionSpec(head_dim=128, q_per_kv=4, mask="causal")
    parsed = spec_from_json(spelled)
    assert parsed == canonical
    assert parsed.to_json() == canonical.to_json()
    assert parsed.hash == canonical.hash


def test_a_spec_without_its_family_is_refused_by_name_not_read_as_the_first_family():
    with pytest.raises(SpecError, match="family: missing.*'attention_fwd'.*'rope'"):
        spec_from_json('{"head_dim": 64}')


def test_defaults_fill_missing_fields():
    assert spec_from_json('{"family": "attention_fwd", "head_dim": 64}') == AttentionSpec(head_dim=64)
    spec = AttentionSpec(head_dim=64)
    assert (spec.head_dim_v, spec.q_per_kv, spec.mask, spec.softcap, spec.dtype, spec.kv_layout, spec.return_lse) == (
        None, 1, "none", False, "bf16", "contiguous", False,
    )


def test_spec_from_json_leaves_a_given_dict_alone():
    data = {"family": "attention_fwd", "ir_version": ir.IR_VERSION, "head_dim": 64, "mask": "causal"}
    copy = dict(data)
    spec_from_json(data)
    assert data == copy


# --------------------------------------------------------------------------------- hash

def test_hash_is_sha256_of_canonical_json():
    for spec in SPECS:
        assert spec.hash == hashlib.sha256(spec.to_json().encode()).hexdigest()[:16]
        assert len(spec.hash) == 16 and int(spec.hash, 16) >= 0


def test_hash_regression():
    """Fixed value: a change here re-keys every generated file, study and tuned row.

    If this fails on purpose (a new field, a changed meaning), bump ``ir.IR_VERSION``.
    """
    assert AttentionSpec(head_dim=64).hash == "b8a21cd1a477f946"
    spec = AttentionSpec(
        head_dim=128, head_dim_v=64, q_per_kv=4, mask="window", softcap=True, dtype="fp16", return_lse=True
    )
    assert spec.hash == "53c2b7dc0f11f651"


#: One changed value per field, from the default spec; must cover every field.
FIELD_CHANGES = {
    "head_dim": 128,
    "head_dim_v": 32,
    "q_per_kv": 2,
    "mask": "causal",
    "softcap": True,
    "dtype": "fp16",
    "kv_layout": "paged",
    "return_lse": True,
    "score_mod": "score_mod;v0:float32=mul(score,2.0);return v0",
    "mask_mod": "mask_mod;v0:bool=ge(q_idx,kv_idx);return v0",
}


def test_field_changes_cover_every_field():
    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(AttentionSpec)}


@pytest.mark.parametrize("field,value", FIELD_CHANGES.items(), ids=list(FIELD_CHANGES))
def test_hash_changes_with_each_field(field, value):
    base = AttentionSpec(head_dim=64)
    changed = base.replace(**{field: value})
    assert changed != base
    assert changed.to_json() != base.to_json()
    assert changed.hash != base.hash


def test_all_single_field_changes_give_distinct_hashes():
    base = AttentionSpec(head_dim=64)
    hashes = {base.hash} | {base.replace(**{f: v}).hash for f, v in FIELD_CHANGES.items()}
    assert len(hashes) == len(FIELD_CHANGES) + 1


def test_hash_changes_with_ir_version(monkeypatch):
    before = AttentionSpec(head_dim=64).hash
    monkeypatch.setattr(ir, "IR_VERSION", ir.IR_VERSION + 1)
    assert AttentionSpec(head_dim=64).hash != before


def test_hash_does_not_depend_on_construction_order():
    a = AttentionSpec(head_dim=64, mask="causal", dtype="fp16")
    b = AttentionSpec(dtype="fp16", mask="causal", head_dim=64)
    assert a.hash == b.hash and hash(a) == hash(b)


def test_name_spells_the_spec_out():
    spec = AttentionSpec(
        head_dim=128, head_dim_v=64, q_per_kv=4, mask="window", softcap=True, dtype="fp16", kv_layout="paged",
        return_lse=True,
    )
    assert spec.name == "attention_fwd_fp16_d128v64_g4_window_softcap_paged_lse"
    assert AttentionSpec(head_dim=64).name == "attention_fwd_bf16_d64_g1_none"


def test_spec_is_frozen():
    spec = AttentionSpec(head_dim=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.head_dim = 128  # type: ignore[misc]


def test_dv():
    assert AttentionSpec(head_dim=64).dv == 64
    assert AttentionSpec(head_dim=64, head_dim_v=32).dv == 32


# ----------------------------------------------------------------------------- validation

BAD_FIELDS = [
    ("head_dim", 0),
    ("head_dim", 8),
    ("head_dim", 65),
    ("head_dim", 264),
    ("head_dim", "64"),
    ("head_dim", 64.0),
    ("head_dim", True),
    ("head_dim", None),
    ("head_dim_v", 12),
    ("head_dim_v", 512),
    ("head_dim_v", "32"),
    ("head_dim_v", False),
    ("q_per_kv", 0),
    ("q_per_kv", -2),
    ("q_per_kv", 1.5),
    ("q_per_kv", True),
    ("mask", "sliding"),
    ("mask", None),
    ("mask", "Causal"),
    ("dtype", "fp64"),
    ("dtype", "float16"),
    ("kv_layout", "strided"),
    ("softcap", 1),
    ("softcap", "yes"),
    ("softcap", None),
    ("return_lse", 0),
    ("return_lse", "true"),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_validation_names_the_field(field, value):
    kwargs = {"head_dim": 64, field: value}
    with pytest.raises(SpecError) as info:
        AttentionSpec(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)
    # The same through JSON (where the value has a JSON spelling) and through replace().
    if isinstance(value, (int, str, bool, type(None))):
        with pytest.raises(SpecError) as info:
            spec_from_json(json.dumps({"family": "attention_fwd", **kwargs}))
        assert info.value.field == field
    with pytest.raises(SpecError) as info:
        AttentionSpec(head_dim=64).replace(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize(
    "data,field",
    [
        pytest.param({"head_dim": 64, "block_m": 64}, "block_m", id="unknown-field"),
        pytest.param({"head_dim": 64, "zzz": 1, "aaa": 2}, "aaa", id="two-unknown-fields"),
        pytest.param({"head_dim": 64, "family": "attention_sideways"}, "family", id="unknown-family"),
        pytest.param({"head_dim": 64, "ir_version": ir.IR_VERSION + 1}, "ir_version", id="newer-ir-version"),
        pytest.param({"head_dim": 64, "ir_version": 0}, "ir_version", id="older-ir-version"),
        pytest.param({"mask": "causal"}, "head_dim", id="missing-head-dim"),
    ],
)
def test_spec_from_json_errors_name_the_field(data, field):
    with pytest.raises(SpecError) as info:
        spec_from_json(json.dumps({"family": "attention_fwd", **data}))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_unknown_field_error_lists_the_known_fields():
    with pytest.raises(SpecError) as info:
        spec_from_json('{"family": "attention_fwd", "head_dim": 64, "block_m": 64}')
    for f in dataclasses.fields(AttentionSpec):
        assert f.name in str(info.value)


@pytest.mark.parametrize("text", ["[64]", "64", '"head_dim"', "null"])
def test_spec_from_json_needs_an_object(text):
    with pytest.raises(SpecError) as info:
        spec_from_json(text)
    assert info.value.field == "spec"


def test_spec_from_json_rejects_malformed_json():
    with pytest.raises(ValueError):
        spec_from_json('{"head_dim": 64')


@pytest.mark.parametrize("value", [16.0, "16", np.int64(16)], ids=["float", "str", "numpy-int"])
@pytest.mark.parametrize("family", ["attention_varlen", "attention_decode", "attention_cascade", "kv_append"])
def test_a_page_size_that_is_not_an_int_is_refused_by_every_paged_spec(family, value):
    """16.0 equals 16, but it would write "16.0" into the canonical JSON (another hash for an equal spec) and into
    the generated module; a numpy int has no JSON spelling at all."""
    extra = {"kv_layout": "paged"} if family == "attention_varlen" else {}
    cls = type(spec_from_json({"family": family, "head_dim": 64, "page_size": 16, **extra}))
    with pytest.raises(SpecError) as info:
        cls(head_dim=64, page_size=value, **extra)
    assert info.value.field == "page_size"
