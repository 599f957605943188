"""The shipped database stays reachable: pinned spec hashes, and dispatch on an H200 finds every row.

The rows were tuned on an H200 with Triton 3.6.0. They are filed under each preset's spec
hash and the attention family's current template hash, so a change to either (a spec field
written differently, a template or shared piece edited) must re-key them in the same commit.
"""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from tilegen import dispatch, env
from tilegen.cli.spec_args import presets
from tilegen.codegen.render import template_hash
from tilegen.db import tuned_rows
from tilegen.device import DeviceInfo
from tilegen.families import family_of

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
SHIPPED_TRITON = "3.6.0"


@pytest.fixture(autouse=True)
def _shipped_triton(monkeypatch):
    """Dispatch as on the machine the rows were tuned on: an H200 under Triton 3.6.0, whatever
    Triton runs the suite (the attention rows' Gluon configs are feasible under 3.6 only, and rows
    are only ever read by the Triton version they were tuned with)."""
    import triton

    monkeypatch.setattr(triton, "__version__", SHIPPED_TRITON)
BUCKETS = [512, 1024, 2048, 4096, 8192, 16384, 32768]

#: Hashes of the shipped presets since IR version 1. A change here orphans every row users tuned.
PINNED = {
    "mha-d128-causal": "47dbe900c9030f94",
    "mha-d64-causal": "4d8c366a15d55ba2",
    "mha-d128": "921b9abe2fdae3af",
    "llama-prefill": "ed084390f0b55d73",
    "gemma-softcap": "99bb8d5466c71391",
}


@pytest.mark.parametrize("preset", sorted(PINNED))
def test_preset_spec_hashes_are_pinned(preset):
    assert presets()[preset].hash == PINNED[preset]


def _shipped_rows(spec_hash: str) -> dict[int, dict]:
    conn = sqlite3.connect(f"file:{env.shipped_db_path()}?mode=ro", uri=True)
    try:
        query = ("select t.bucket, t.config_json from tg_tuned_configs t join tg_variants v on v.id = t.variant_id "
                 "where v.spec_hash = ?")
        return {bucket: config for bucket, config in conn.execute(query, (spec_hash,))}
    finally:
        conn.close()


@pytest.mark.parametrize("preset", sorted(PINNED))
def test_dispatch_on_an_h200_finds_every_shipped_row(preset, tmp_path):
    spec = presets()[preset]
    family = family_of(spec)
    raw = _shipped_rows(spec.hash)
    assert sorted(raw) == BUCKETS, "the shipped database lost rows of this preset"
    rows = tuned_rows(spec, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(rows) == BUCKETS
    for bucket, (config, source) in rows.items():
        assert config.to_json() == raw[bucket]
        assert source == str(env.shipped_db_path())
        assert family.feasible(spec, config, H200) is None
    table = dispatch.Table(spec, H200, rows)
    assert table.choose(3000).tuned_bucket == 4096 and table.choose(3000).source == str(env.shipped_db_path())


#: Serving presets tuned on the H200: the ragged one down to 512-token sequences.
SERVING = {"varlen-llama": [512, 1024, 2048, 8192], "paged16-llama": [2048, 8192]}


@pytest.mark.parametrize("preset", sorted(SERVING))
def test_dispatch_on_an_h200_finds_the_shipped_serving_rows(preset, tmp_path):
    spec = presets()[preset]
    family = family_of(spec)
    rows = tuned_rows(spec, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(rows) == SERVING[preset]
    for config, source in rows.values():
        assert source == str(env.shipped_db_path()) and family.feasible(spec, config, H200) is None


#: The dense decode route's H200 rows (GQA 32/8, d=128, bf16), by (longest context, batch): the batch
#: each row's trials measured. The first rows measured 64 sequences up to 4k, then 2**18 KV tokens'
#: worth (8 at 64k, 3 at 128k); later ones tuned tilegen.bench.decode's own shapes.
DECODE_SPEC = {"family": "attention_decode", "head_dim": 128, "q_per_kv": 4, "dtype": "bf16", "kv_layout": "dense"}
DECODE_HASH = "0675482e97e41f8a"
DECODE_ROWS = [(1024, 64), (1024, 256), (4096, 64), (65536, 4), (65536, 8), (131072, 1), (131072, 4)]
#: tilegen.bench.decode's shapes, (context, batch), and the row each should run: its own.
DECODE_BENCH = {(4096, 64): (4096, 64), (1024, 256): (1024, 256), (131072, 1): (131072, 1),
                (65536, 4): (65536, 4)}


#: PagedDecode's H200 rows (page 16, same heads), tuned at tilegen.bench.decode's shapes with full contexts.
PAGED_SPEC = {**DECODE_SPEC, "kv_layout": "paged", "page_size": 16}
PAGED_HASH = "a2a5b6f270671787"
PAGED_ROWS = [(1024, 256), (4096, 64), (65536, 4), (131072, 1)]


@pytest.mark.parametrize(("spec_json", "spec_hash", "shipped", "bench"), [
    (DECODE_SPEC, DECODE_HASH, DECODE_ROWS, DECODE_BENCH),
    (PAGED_SPEC, PAGED_HASH, PAGED_ROWS, {shape: shape for shape in PAGED_ROWS}),
], ids=["dense", "paged16"])
def test_dispatch_on_an_h200_finds_the_shipped_decode_rows_for_the_benchmark_shapes(
        tmp_path, spec_json, spec_hash, shipped, bench):
    from tilegen.families import spec_from_json

    spec = spec_from_json(json.dumps(spec_json))
    family = family_of(spec)
    assert spec.hash == spec_hash
    raw = _shipped_rows(spec.hash)
    assert sorted(raw) == [family.buckets.of(shape) for shape in shipped], "rows lost or keyed by context alone"
    rows = tuned_rows(spec, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(rows) == sorted(raw)
    for config, source in rows.values():
        assert source == str(env.shipped_db_path()) and family.feasible(spec, config, H200) is None
    table = dispatch.Table(spec, H200, rows)
    for (context, batch), row in bench.items():
        choice = table.choose((context, batch))
        assert choice.tuned_bucket == family.buckets.of(row), (context, batch)
        assert choice.source == str(env.shipped_db_path())
        assert choice.config.to_json() == raw[choice.tuned_bucket]


def test_the_shipped_trials_are_filed_under_their_rows_buckets():
    conn = sqlite3.connect(f"file:{env.shipped_db_path()}?mode=ro", uri=True)
    try:
        query = ("select t.bucket, t.study_name from tg_trials t join tg_variants v on v.id = t.variant_id "
                 "where v.spec_hash = ?")
        trials = conn.execute(query, (DECODE_HASH,)).fetchall()
    finally:
        conn.close()
    assert {bucket for bucket, _ in trials} == set(_shipped_rows(DECODE_HASH))
    # A bucket tuned again files its new trials under a numbered study, "-n<bucket>-run2".
    assert all(re.search(rf"-n{bucket}(-run\d+)?$", study) for bucket, study in trials)


def test_the_shipped_file_is_self_contained():
    """Rollback-journal mode, as tuning_db/README.md says: the file alone holds every row (no -wal
    beside it to ship too), and a reader leaves no -shm and -wal files in a checkout."""
    uri = f"file:{env.shipped_db_path()}?mode=ro"
    with sqlite3.connect(uri, uri=True) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


#: The attention backward's presets, tuned on the H200 at 1k, 4k and 16k; their hashes, which a backward spec
#: without mods keeps now that the spec can hold mods.
TRAINING = {"train-llama": "3fc524ac248d7e47", "train-llama-full": "2b723e47f831d430",
            "train-d128": "a438c731506eef5b", "train-d128-full": "b9e683deddcb567d", "train-d64": "0e30629ff939228d",
            "train-d64-full": "4b2466654337abf5", "train-d64-gqa": "b6b6191d4f0c1de0",
            "train-d64-gqa-full": "384fb1c19782c113"}


@pytest.mark.parametrize("preset", sorted(TRAINING))
def test_dispatch_on_an_h200_finds_the_shipped_backward_rows(preset, tmp_path):
    spec = presets()[preset]
    family = family_of(spec)
    assert spec.hash == TRAINING[preset]
    rows = tuned_rows(spec, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(rows) == [1024, 4096, 16384]
    for config, source in rows.values():
        assert source == str(env.shipped_db_path()) and family.feasible(spec, config, H200) is None


@pytest.mark.parametrize("preset", ["train-llama", "train-llama-full", "train-d64-gqa"])
def test_a_ragged_backward_takes_the_dense_rows_its_kernels_run(preset, tmp_path, monkeypatch):
    """A packed batch's backward has no rows of its own: it is served the dense spec's where the ragged kernels run
    their config, and its own default where they do not (the warp-specialized kernel adding dQ by reductions, the
    shipped full-mask rows': served, the launch would fall to the Triton kernels with atomics)."""
    from tilegen.families.attention_bwd import config as bwd_config

    monkeypatch.setattr(bwd_config, "has_wgmma", lambda device: True)  # feasible's view of Hopper under Triton 3.6
    dense = presets()[preset]
    ragged = dense.replace(layout="ragged")
    family = family_of(ragged)
    shipped = tuned_rows(dense, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    rows = tuned_rows(ragged, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(shipped) == [1024, 4096, 16384]
    for bucket, (config, _) in shipped.items():
        if family.feasible(ragged, config, H200) is None:
            assert rows[bucket][0] == config and rows.tuned_for[bucket] == dense.name
        else:
            assert config.atomic_dq and config.wgmma == 3 and bucket not in rows
    assert bool(rows) == (dense.mask == "causal")
