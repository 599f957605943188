"""The shipped database stays reachable: pinned spec hashes, and dispatch on an H200 finds every row.

The rows were tuned on an H200 with Triton 3.6.0. They are filed under each preset's spec
hash and the attention family's current template hash, so a change to either (a spec field
written differently, a template or shared piece edited) must re-key them in the same commit.
"""

from __future__ import annotations

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


#: Serving presets tuned on the H200 at two buckets each.
SERVING = {"varlen-llama": [2048, 8192], "paged16-llama": [2048, 8192]}


@pytest.mark.parametrize("preset", sorted(SERVING))
def test_dispatch_on_an_h200_finds_the_shipped_serving_rows(preset, tmp_path):
    spec = presets()[preset]
    family = family_of(spec)
    rows = tuned_rows(spec, H200, template_hash(family), SHIPPED_TRITON, user_db=tmp_path / "none.sqlite")
    assert sorted(rows) == SERVING[preset]
    for config, source in rows.values():
        assert source == str(env.shipped_db_path()) and family.feasible(spec, config, H200) is None
