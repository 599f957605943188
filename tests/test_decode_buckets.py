"""The decode family's bucket: longest context and batch packed into one database int.

The rule itself (round trip, 32 bits, rounding, nearest row, what a writer refuses), then a
tune of the decode preset at two batches under the interpreter, and dispatch in a fresh
process picking the row of its batch.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from tilegen.cli import app
from tilegen.codegen.render import template_hash
from tilegen.db import RowError, TuningDB
from tilegen.device import CPU_INTERPRETER, device_info
from tilegen.families import get
from tilegen.families.attention_decode import DecodeConfig, DecodeProblem, DecodeSpec

ROOT = Path(__file__).resolve().parent.parent
FAMILY = get("attention_decode")
RULE = FAMILY.buckets
SMALL = DecodeSpec(head_dim=32, q_per_kv=4, dtype="fp32", page_size=16)


def test_a_bucket_round_trips_and_fits_a_signed_32_bit_column():
    contexts = [1 << k for k in range(4, 31)]  # 16 .. 2**30, past the 2**24 a serving context reaches
    batches = [1 << k for k in range(15)]  # 1 .. 2**14, past 2**12
    packed = {(c, b): RULE.of((c, b)) for c in contexts for b in batches}
    assert len(set(packed.values())) == len(packed), "two (context, batch) buckets share an int"
    for (context, batch), bucket in packed.items():
        assert 0 < bucket < 2**31
        assert RULE.check(bucket) is None
        assert RULE.unpack(bucket) == (context, batch)
        assert RULE.of(RULE.unpack(bucket)) == bucket
    # Integer order is context first, then batch (what `db list` sorts by).
    assert sorted(packed, key=packed.get) == sorted(packed)
    assert RULE.of((4096, 64)) == 4096 | 7 and RULE.label(4103) == "4096 ctx x 64 seqs"
    assert RULE.label(RULE.of((131072, 1))) == "131072 ctx x 1 seq"
    assert RULE.of((2**31 - 1, 10**9)) == RULE.of((2**30, 2**14)) < 2**31  # past the caps: the largest bucket


@pytest.mark.parametrize(
    "size, context, batch",
    [
        ((1, 1), 16, 1),
        ((0, 0), 16, 1),  # an empty step buckets with the smallest
        ((4096, 17), 4096, 32),
        ((1000, 257), 1024, 512),
        ((4097, 1000), 8192, 1024),
        ((65536, 4), 65536, 4),
        ((131072, 3), 131072, 4),
    ],
)
def test_of_rounds_context_and_batch_up_to_powers_of_two(size, context, batch):
    assert RULE.unpack(RULE.of(size)) == (context, batch)


@given(context=st.integers(0, 2**30), batch=st.integers(0, 2**14))
def test_of_gives_the_smallest_power_of_two_buckets_that_hold_the_call(context, batch):
    bucket = RULE.of((context, batch))
    got_context, got_batch = RULE.unpack(bucket)
    assert RULE.check(bucket) is None and 0 < bucket < 2**31
    assert max(context, 16) <= got_context < 2 * max(context, 16)
    assert max(batch, 1) <= got_batch < 2 * max(batch, 1)


@given(call=st.tuples(st.integers(1, 2**24), st.integers(1, 2**12)),
       rows=st.sets(st.tuples(st.integers(4, 24), st.integers(0, 12)), min_size=1, max_size=12))
def test_nearest_is_a_row_at_the_least_context_distance_then_the_least_batch_distance(call, rows):
    tuned = [RULE.of((1 << c, 1 << b)) for c, b in rows]
    context, batch = (n.bit_length() for n in RULE.unpack(RULE.of(call)))

    def distance(bucket):
        c, b = RULE.unpack(bucket)
        return abs(c.bit_length() - context), abs(b.bit_length() - batch)

    chosen = RULE.nearest(RULE.of(call), tuned)
    assert chosen in tuned
    assert distance(chosen) == min(map(distance, tuned))
    assert chosen == RULE.nearest(RULE.of(call), list(reversed(tuned)))  # whatever the rows' order


def test_of_wants_the_pair_and_names_the_argument():
    with pytest.raises(TypeError, match=r"size: expected a \(longest context, sequences\) pair"):
        RULE.of(4096)
    with pytest.raises(ValueError, match="size: expected"):
        RULE.of((4096, -1))


TUNED = {(1024, 64), (4096, 64), (4096, 1), (65536, 8), (131072, 4)}


@pytest.mark.parametrize(
    "call, row",
    [
        ((4096, 64), (4096, 64)),  # exact
        ((4096, 256), (4096, 64)),  # batch only
        ((4096, 2), (4096, 1)),  # nearer batch of the same context
        ((4096, 8), (4096, 64)),  # 3 octaves either way: the larger batch
        ((8192, 1), (4096, 1)),  # context before batch
        ((2048, 1), (4096, 1)),  # between 1024 and 4096: the larger context, then its nearer batch
        ((1024, 1), (1024, 64)),  # the only row of the context, whatever its batch
        ((262144, 1), (131072, 4)),
    ],
)
def test_nearest_takes_the_context_then_the_batch_and_is_deterministic(call, row):
    tuned = [RULE.of(t) for t in TUNED]
    for seed in range(3):
        random.Random(seed).shuffle(tuned)
        assert RULE.unpack(RULE.nearest(RULE.of(call), tuned)) == row


def test_a_context_only_bucket_is_refused_by_every_writer(tmp_path):
    key = {"spec": SMALL, "device": CPU_INTERPRETER, "template_hash": template_hash(FAMILY),
           "triton_version": triton.__version__}
    row = dict(**key, config=DecodeConfig(32, 4, 1, 1).to_dict(), time_ms=1.0, max_error=1e-4, trials=2)
    with TuningDB(tmp_path / "a.sqlite") as db:
        for bad, why in ((64, "no batch"), (48, "not a power of two")):
            with pytest.raises(RowError, match=f"bucket: {bad} is not a bucket of attention_decode .*{why}"):
                db.record_best(**row, bucket=bad)
        # Past 32 bits no rule is asked: the column holds 32-bit buckets, and every packed bucket fits.
        with pytest.raises(RowError, match=f"bucket: expected a positive integer of 32 bits, got {2**31 + 1}"):
            db.record_best(**row, bucket=2**31 + 1)
        db.record_best(**row, bucket=RULE.of((64, 4)))
        exported = db.export_json()
    # An export edited back to a context-only bucket: import refuses it in one line naming the row.
    exported["tuned"][0]["bucket"] = 64
    path = tmp_path / "old.json"
    path.write_text(json.dumps(exported))
    result = CliRunner().invoke(app, ["db", "--db", str(tmp_path / "b.sqlite"), "import", str(path)])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "bucket: 64 is not a bucket of attention_decode" in result.stderr
    assert "re-key such a row with the batch it measured" in result.stderr


def test_the_problem_measures_the_bucket_s_batch_and_context_and_sizes_the_window_from_the_context():
    dense = DecodeSpec(head_dim=32, q_per_kv=2, dtype="fp32", kv_layout="dense", mask="window")
    on_gpu = DecodeProblem.for_bucket(dense, RULE.of((65536, 8)), on_gpu=True)
    assert on_gpu.k_lens == (65536,) * 8 and on_gpu.bounds == (16384, 4096)
    paged = DecodeProblem.for_bucket(SMALL, RULE.of((4096, 256)), on_gpu=True)
    assert paged.k_lens == (4096,) * 256  # full contexts: the regime the split rule is tuned for
    cpu = DecodeProblem.for_bucket(SMALL, RULE.of((4096, 4)), on_gpu=False)
    assert cpu.k_lens == (48, 0, 1, 17)  # capped context; an empty, a one-token and a page-crossing one
    assert DecodeProblem.for_bucket(SMALL, RULE.of((32, 1)), on_gpu=False).k_lens == (32,)
    with pytest.raises(ValueError, match="bucket: 4096 is not a longest context x sequences bucket"):
        DecodeProblem.for_bucket(SMALL, 4096, on_gpu=False)


@pytest.mark.skipif(not device_info().is_interpreter, reason="tunes under the CPU interpreter")
def test_a_tune_at_two_batches_writes_two_rows_and_fresh_dispatch_takes_the_row_of_its_batch(tmp_path, monkeypatch):
    made: list[DecodeProblem] = []
    problem = DecodeProblem.for_bucket

    def recording(*args, **kwargs):
        made.append(problem(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(DecodeProblem, "for_bucket", recording)
    db = tmp_path / "tuning.sqlite"
    result = CliRunner().invoke(app, ["tune", "--preset", "decode16-llama", "--sizes", "32", "--batches", "1,3",
                                      "--trials", "1", "--db", str(db)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    one, four = RULE.of((32, 1)), RULE.of((32, 4))
    assert "32 ctx x 1 seq" in result.stdout and "32 ctx x 4 seqs" in result.stdout  # the summary's labels
    assert {p.bucket: p.batch for p in made} == {one: 1, four: 4}
    spec = FAMILY.presets["decode16-llama"]
    with TuningDB(db) as tdb:
        rows = {r.bucket: r for r in tdb.list_tuned()}
        trials = tdb.trials_for(spec.hash)
    assert sorted(rows) == [one, four]
    assert sorted(t.bucket for t in trials) == [one, four]
    for p in made:  # each row's K and V bytes per second are those of the problem at its batch
        row = rows[p.bucket]
        assert row.gbps * row.time_ms * 1e6 == pytest.approx(p.bytes_moved(), rel=1e-6)
        # The summary shows the bucket's GB/s, the figure of merit of a memory-bound kernel.
        line = next(ln for ln in result.stdout.splitlines() if RULE.label(p.bucket) + " " in ln)
        assert f"{row.gbps:.4g}" in line

    script = textwrap.dedent("""
        import json, torch, tilegen
        choices = {}
        for batch in (1, 2, 3, 300):
            k = torch.randn(2 * batch, 16, 8, 128, dtype=torch.bfloat16)
            table = torch.arange(2 * batch, dtype=torch.int32).view(batch, 2)
            cache = tilegen.PagedKVCache.from_block_table(k, torch.randn_like(k), table, torch.full((batch,), 30))
            choice = tilegen.PagedDecode().plan(cache, heads_q=32)
            choices[batch] = [choice.tuned_bucket, choice.source, repr(choice)]
        print(json.dumps(choices))
    """)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # the caller's Triton too
    env = {**os.environ, "PYTHONPATH": path, "TILEGEN_DB": str(db), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    choices = {int(b): c for b, c in json.loads(done.stdout).items()}
    # Batch 2 is one octave from both rows: the larger batch's.
    assert {b: c[0] for b, c in choices.items()} == {1: one, 2: four, 3: four, 300: four}
    assert {c[1] for c in choices.values()} == {str(db)}
    assert f"tuned_bucket={four} (32 ctx x 4 seqs)" in choices[3][2]


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--preset", "decode16-llama", "--batches", "abc"], "--batches: expected comma-separated",
                     id="not-a-number"),
        pytest.param(["--preset", "decode16-llama", "--batches", "4,0"], "--batches: expected comma-separated",
                     id="zero"),
        pytest.param(["--preset", "decode16-llama", "--batches", "1,,4"], "--batches: expected comma-separated",
                     id="empty-item"),
        pytest.param(["--preset", "default", "--batches", "4"], "--batches: attention_fwd buckets one size",
                     id="family-without-a-batch"),
    ],
)
def test_bad_batches_end_in_one_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "fresh.sqlite"), *args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "fresh.sqlite").exists()  # refused before anything was opened


def test_gpu_defaults_cross_contexts_and_batches_and_skip_what_the_gpu_cannot_hold(capsys):
    from tilegen.cli.tune import _buckets
    from tilegen.device import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
    spec = FAMILY.presets["decode16-llama"]
    defaults = _buckets(spec, FAMILY, h200, [], [])
    assert [RULE.unpack(b) for b in defaults] == [(c, b) for c in (1024, 4096, 16384, 65536) for b in (1, 8, 64)]
    # 131072 tokens by 1024 sequences: some 130 GB of K and V, over half of the H200.
    kept = _buckets(spec, FAMILY, h200, [131072, 1000], [1, 1024])
    assert kept == sorted(RULE.of(s) for s in [(1024, 1), (1024, 1024), (131072, 1)])
    assert "skipping 131072 ctx x 1024 seqs" in capsys.readouterr().err


def test_the_no_row_hint_names_the_context_and_the_batch_to_tune():
    from tilegen import dispatch

    command = dispatch.tune_command(SMALL, RULE.of((4096, 64)))
    assert command.endswith("--sizes 4096 --batches 64")
    table = dispatch.Table(SMALL, CPU_INTERPRETER, {})
    choice = table.choose((3000, 50))
    assert (choice.source, choice.bucket) == ("default", RULE.of((4096, 64)))
    assert "bucket=4103 (4096 ctx x 64 seqs), tuned_bucket=None" in repr(choice)
