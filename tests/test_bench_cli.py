"""``tilegen bench NAME``: every benchmark module behind one command, and the prefill benchmark's plot."""

from __future__ import annotations

import json
import pkgutil

import pytest
import torch
from typer.testing import CliRunner

import tilegen.bench
from tilegen.cli import app

runner = CliRunner()


def test_the_help_lists_every_benchmark_with_what_it_measures():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    names = [m.name for m in pkgutil.iter_modules(tilegen.bench.__path__) if not m.name.startswith("_")]
    assert len(names) >= 10
    for name in names:
        assert f" {name} " in result.output
    assert "Attention-forward benchmark" in result.output and "Batch decode on a GPU" in result.output


def test_an_unknown_benchmark_fails_in_one_line_naming_the_choices():
    result = runner.invoke(app, ["bench", "prefil"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: NAME: no benchmark 'prefil'; choose one of attention, backward, blockwise, bookkeeping, cascade, "
        "coldstart, decode, hosttime, mods, scaleout, serving, serving_kernels, tuning"]


def test_a_benchmark_gets_the_flags_after_its_name():
    result = runner.invoke(app, ["bench", "attention", "-h"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("usage: tilegen bench attention") and "--plot PNG" in result.output
    # Its own checks run on its own flags: a bad one fails there, before any GPU work.
    result = runner.invoke(app, ["bench", "attention", "--dtypes", "fp8"])
    assert result.exit_code == 2 and "--dtypes: expected bf16 and/or fp16" in result.output


def test_help_after_a_benchmark_name_is_the_benchmarks_own():
    """``--help`` after NAME lists the benchmark's flags, as ``-h`` does, not the help of ``tilegen bench``."""
    result = runner.invoke(app, ["bench", "decode", "--help"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("usage: tilegen bench decode") and "--q-tokens" in result.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message a machine without a GPU gets")
@pytest.mark.parametrize("name", ["attention", "decode", "serving", "cascade", "mods"])
def test_without_a_gpu_a_gpu_benchmark_says_so_in_one_line(name):
    result = runner.invoke(app, ["bench", name])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: tilegen.bench.{name} times CUDA kernels; run it on a GPU"]


def test_the_plot_has_a_panel_per_variant_and_a_line_per_provider(tmp_path):
    pytest.importorskip("matplotlib")
    from tilegen.bench.attention import plot

    rows = []
    for variant in ("d=128 causal", "d=64 full gqa4"):
        for n, scale in ((1024, 1.0), (4096, 1.2), (16384, 1.3)):
            row = {"variant": variant, "seqlen": n, "case": f"N={n} {variant}"}
            row.update({name: {"tflops": 300 * scale + i} for i, name in enumerate(("tilegen", "sdpa-cudnn", "flex"))})
            row["sdpa-flash"] = {"error": "not on this GPU"}  # a missing peer leaves its line out
            rows.append(row)
    path = tmp_path / "attention.png"
    assert plot(rows, str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.parametrize("value, message", [
    ("9", "--q-tokens: each must be 1 to 8 (the decode family's), got '9'"),
    ("2,x", "--q-tokens: expected comma-separated whole numbers, got '2,x'"),
    ("2 --padded", "--padded: a bf16 decoding step of one query token"),
])
def test_the_decode_benchmark_checks_its_query_tokens_before_any_gpu_work(value, message):
    result = runner.invoke(app, ["bench", "decode", "--q-tokens", *value.split()])
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize("value", ["19x", "192/128/64", "0/128"])
def test_the_serving_benchmark_checks_its_head_dims_before_any_gpu_work(value):
    result = runner.invoke(app, ["bench", "serving", "--head-dims", value])
    expected = f"--head-dims: expected D or D/DV, positive integers, got '{value}'"
    assert result.exit_code == 2 and expected in result.output


@pytest.mark.parametrize("value, message", [("100", "head_dim: expected a multiple of 8 in [16, 256], got 100"),
                                            ("128/300", "head_dim_v")])
def test_the_serving_benchmark_refuses_head_dims_the_ops_do_not_take(value, message):
    result = runner.invoke(app, ["bench", "serving", "--head-dims", value])
    assert result.exit_code == 2 and f"--head-dims {value}: " in result.output and message in result.output


def test_the_padded_decoding_step_benchmark_runs_every_provider(monkeypatch):
    """``--padded``'s case on the CPU (the interpreter, small heads), each provider called once where the GPU run
    times it: both integration paths agree with SDPA, and every provider has a figure."""
    from tilegen.bench import decode as bench

    monkeypatch.setattr(bench, "HQ", 4)
    monkeypatch.setattr(bench, "HKV", 2)
    monkeypatch.setattr(bench, "D", 16)
    timed = []
    monkeypatch.setattr(bench, "_bench", lambda fn: timed.append(fn()) or 1.0)
    row = bench.padded_case(3, 37, device="cpu")
    assert row["rel_err"] < 1e-2 and row["ragged_rel_err"] < 1e-2 and len(timed) == 4
    assert all(row[name] > 0 for name in ("integration", "integration-ragged", "sdpa-masked", "tilegen-dense"))


def test_the_decode_benchmark_takes_turns_and_reports_each_providers_median(monkeypatch):
    """The paged decode's case on the CPU (the interpreter, small heads) with --rounds: every provider that runs is
    timed once a round, the order rotating, each GB/s from the median of its rounds; FP8 pages count their bytes."""
    from tilegen.bench import decode as bench

    monkeypatch.setattr(bench, "HQ", 4)
    monkeypatch.setattr(bench, "HKV", 2)
    monkeypatch.setattr(bench, "D", 16)
    order = []
    names = {}

    def timed(fn):
        name = names.setdefault(fn, f"p{len(names)}")
        order.append(name)
        return {"p0": [4.0, 1.0, 2.0]}.get(name, [1.0, 1.0, 1.0])[order.count(name) - 1]

    monkeypatch.setattr(bench, "_bench", timed)
    row = bench.case(2, 48, 16, ("fp8e4m3",), rounds=3, device="cpu")
    assert row["rel_err"] < 1e-2 and row["dense_rel_err"] < 1e-2 and row["fp8e4m3_rel_err"] < 5e-2
    timed_names = [n for n in ("tilegen-paged", "sdpa-flash", "sdpa-cudnn", "tilegen-paged-fp8e4m3", "tilegen-dense")
                   if f"{n} rounds" in row]
    assert "tilegen-paged" in timed_names and "tilegen-paged-fp8e4m3" in timed_names and "tilegen-dense" in timed_names
    providers = len(timed_names)
    assert len(order) == 3 * providers and order[0] != order[providers]  # each round once, the first rotating
    gb = 2 * 2 * 2 * 48 * 16 * 2 / 1e9
    assert row["tilegen-paged"] == pytest.approx(gb / 2.0 * 1e3)  # the median of 4, 1, 2 ms
    assert row["tilegen-paged rounds"] == pytest.approx([gb / t * 1e3 for t in (4.0, 1.0, 2.0)])
    assert row["tilegen-paged-fp8e4m3"] == pytest.approx(gb / 2 * 1e3)  # one byte a value, 1 ms
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "2", "--padded"])


def test_rounds_alternate_the_providers_and_report_each_ones_median(monkeypatch):
    """With --rounds the providers of a case take turns, the order rotating, and each figure is the median of
    its rounds; a provider that fails while timed is reported as an error, not fatal."""
    import torch

    from tilegen.bench import attention as bench

    q = torch.randn(1, 32, 8, 16)
    calls, ms = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def do_bench(fn, **_):
        name = fn()
        calls.append(name)
        if name == "c":
            raise RuntimeError("out of memory")
        return next(ms[name])

    monkeypatch.setattr(bench, "_inputs", lambda case: (q, q, q))
    monkeypatch.setattr(bench, "_providers", lambda case, inputs, configs: {n: (lambda *_, n=n: n) for n in "abc"})
    monkeypatch.setattr(bench, "_rel_err", lambda out, ref: 0.0)
    monkeypatch.setattr(bench.tilegen, "explain", lambda *a, **k: type("C", (), {"config": "cfg", "source": "default"}))
    monkeypatch.setattr(bench, "prepare_call", lambda *a: (None, ))
    monkeypatch.setattr(bench.Case, "flops", lambda self, spec: 1e9)
    monkeypatch.setattr(bench.triton.testing, "do_bench", do_bench)
    row = bench.bench_case(bench.Case(8, 16, False), rounds=3)
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]
    assert row["a"]["ms"] == 2.0 and row["a"]["ms_rounds"] == [3.0, 1.0, 2.0] and row["b"]["ms"] == 5.0
    assert row["a"]["tflops"] == 1e9 / 2.0 * 1e-9
    assert row["c"] == {"error": "RuntimeError: out of memory"}
    result = runner.invoke(app, ["bench", "attention", "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds: expected a positive number" in result.output


def test_rounds_with_every_provider_failing_its_check_report_the_errors(monkeypatch):
    """A case whose providers all fail before timing (say, out of memory on its inputs) comes back as a row of
    errors, whatever the rounds."""
    import torch

    from tilegen.bench import attention as bench

    q = torch.randn(1, 32, 8, 16)

    def fails(*_):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench, "_inputs", lambda case: (q, q, q))
    monkeypatch.setattr(bench, "_providers", lambda case, inputs, configs: {n: fails for n in "ab"})
    monkeypatch.setattr(bench.tilegen, "explain", lambda *a, **k: type("C", (), {"config": "cfg", "source": "default"}))
    monkeypatch.setattr(bench, "prepare_call", lambda *a: (None, ))
    monkeypatch.setattr(bench.Case, "flops", lambda self, spec: 1e9)
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, **_: pytest.fail("nothing should be timed"))
    row = bench.bench_case(bench.Case(8, 16, False), rounds=3)
    assert row["a"] == row["b"] == {"error": "RuntimeError: out of memory"}


def test_forced_configs_are_providers_and_one_the_spec_cannot_run_is_an_error_in_its_column(monkeypatch):
    """--configs: each config a provider ``tilegen <config>`` running the generated kernel under it; one the spec
    cannot run fails its check by name, and a list that is not one of configs is refused before any GPU work."""
    import torch

    from tilegen.bench import attention as bench
    from tilegen.families.attention_fwd import Config

    q = torch.randn(1, 32, 16, 64)
    monkeypatch.setattr(bench, "_inputs", lambda case: (q, q, q))
    monkeypatch.setattr(bench, "peers", lambda *a: {})
    monkeypatch.setattr(bench, "_rel_err", lambda out, ref: 0.0)
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, **_: fn() is not None and 1.0)
    ran = []
    monkeypatch.setattr(bench, "run_with_config", lambda spec, config, *a: ran.append(config) or (q, None))
    good, bad = Config(64, 64, 4, 2), Config(64, 48, 4, 2)
    row = bench.bench_case(bench.Case(16, 64, True), only={"tilegen-default"}, configs=[good, bad])
    assert set(row) >= {"tilegen-default", f"tilegen {good}", f"tilegen {bad}"} and "tilegen" not in row
    assert row[f"tilegen {good}"]["ms"] == 1.0 and good in ran
    assert "does not run attention_fwd" in row[f"tilegen {bad}"]["error"] and "block_n=48" in row[f"tilegen {bad}"]["error"]
    assert f"tilegen {good}" in bench._table([row], [good, bad])
    for given, message in (("{", "--configs: expected a JSON list"), ('[{"block_m": 64}]', "--configs: expected")):
        result = runner.invoke(app, ["bench", "attention", "--configs", given])
        assert result.exit_code == 2 and message in result.output, result.output


def test_the_mods_plot_draws_what_a_run_measured(tmp_path):
    """The mods benchmark's plot from rows as it writes them: a backward panel only when the backward ran, and
    failed cells (strings) left out."""
    from tilegen.bench.mods import plot

    pytest.importorskip("matplotlib")
    rows = [{"mod": "alibi", "flex TFLOP/s": 300.0, "tilegen TFLOP/s": 320.0, "flex bwd us": 9.0,
             "flex bwd TFLOP/s": 200.0, "tilegen bwd TFLOP/s": 250.0, "tilegen bwd us": "wrong"},
            {"mod": "relative-bias", "flex TFLOP/s": 90.0, "tilegen us": "OutOfResources"}]
    path = tmp_path / "mods.png"
    assert plot(rows, str(path)) == str(path) and path.stat().st_size > 10_000


def test_head_dims_take_a_narrower_v_and_refuse_what_is_not_one():
    """--head-dims: D or D/DV; a case with a V dim names it in its variant (one panel of the plot), and anything
    else is refused before any GPU work."""
    from tilegen.bench import attention as bench

    case = bench.Case(512, 192, True, 8, "bf16", 128)
    assert case.dv == 128 and case.variant == "d=192v128 causal gqa4" and bench.Case(512, 64, False).dv == 64
    for given in ("192/x", "192/128/64", "0", "-64"):
        result = runner.invoke(app, ["bench", "attention", "--head-dims", given])
        assert result.exit_code == 2 and "--head-dims: expected comma-separated D or D/DV" in result.output, given


def test_softcap_cases_carry_their_cap_and_a_reference_that_agrees_with_the_familys():
    """--softcap: every case's scores capped (named in the variant); its reference, a head at a time in float32,
    agrees with the family's float64 reference (GQA, causal bottom-right with more keys than queries); a cap that
    is not a positive finite number is refused before any GPU work."""
    from tilegen.bench import attention as bench
    from tilegen.families.attention_fwd.reference import attention_reference

    assert bench.Case(512, 256, True, 16, softcap=50.0).variant == "d=256 causal gqa2 softcap 50"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 17, 32, generator=gen) * 4
    k, v = (torch.randn(2, 2, 23, 32, generator=gen) * 4 for _ in range(2))
    ref, _ = attention_reference(q, k, v, causal=True, softcap=5.0)
    got = bench.softcap_reference(q, k, v, True, 5.0)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
    for given in ("0", "-3", "nan", "inf"):
        result = runner.invoke(app, ["bench", "attention", "--softcap", given])
        assert result.exit_code == 2 and "--softcap: expected a positive finite cap" in result.output, given


def test_bench_attention_window():
    """--window: a sliding window in every case (named in the variant, passed to the op as (keys, 0)); the softcap
    reference's window agrees with the family's float64 reference; FLOPs count the pairs the window lets through;
    a negative window is refused before any GPU work."""
    from tilegen.bench import attention as bench
    from tilegen.families.attention_fwd import AttentionSpec
    from tilegen.families.attention_fwd.reference import attention_reference

    case = bench.Case(1024, 128, False, 8, window=100)
    assert case.variant == "d=128 window 100 gqa4" and case.bounds == (100, 0)
    spec = AttentionSpec(head_dim=128, q_per_kv=4, mask="window", dtype="bf16")
    pairs = sum(min(i, 100) + 1 for i in range(1024))
    assert case.flops(spec) == 2.0 * case.batch * bench.HEADS * pairs * 256
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 17, 32, generator=gen) * 4
    k, v = (torch.randn(2, 2, 23, 32, generator=gen) * 4 for _ in range(2))
    ref, _ = attention_reference(q, k, v, window=(5, 0), softcap=5.0)
    got = bench.softcap_reference(q, k, v, False, 5.0, window=5)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
    result = runner.invoke(app, ["bench", "attention", "--window", "-1"])
    assert result.exit_code == 2 and "--window: expected a count of keys >= 0" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's re-run, which only a CPU makes")
@pytest.mark.parametrize("args, message", [
    (["serving_kernels", "--smoke", "--parts", "append,foo"], "--parts: unknown part 'foo'; known: append, merge"),
    (["blockwise", "--smoke", "--lengths", "x"], "--lengths: expected comma-separated ints, got 'x'"),
    (["blockwise", "--smoke", "--runs", "0"], "--runs: expected at least 1"),
])
def test_a_smoke_run_checks_its_flags_before_rerunning_under_the_interpreter(args, message, monkeypatch):
    """Without TRITON_INTERPRET a smoke run starts itself again under the interpreter; a bad flag is refused before
    that, so the command's one-line error and status 2 name it, not the child's bare message and status 1."""
    import tilegen.bench.blockwise
    import tilegen.bench.serving_kernels

    def rerun(*args, **kwargs):
        raise AssertionError(f"re-ran a benchmark with a bad flag: {args}")

    for module in (tilegen.bench.blockwise, tilegen.bench.serving_kernels):
        monkeypatch.setattr(module, "interpreting", lambda: False)
        monkeypatch.setattr(module.subprocess, "run", rerun)
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {message}"]


def test_the_merge_benchmark_checks_the_lse_values_not_only_where_they_are_infinite(monkeypatch):
    import tilegen
    from tilegen.bench.serving_kernels import merge_rows

    merge = tilegen.merge_states

    def off_by_one(*args, **kwargs):  # the right output, a wrong LSE
        o, lse = merge(*args, **kwargs)
        return o, lse + 1

    monkeypatch.setattr(tilegen, "merge_states", off_by_one)
    rows = merge_rows(heads=2, dim=16, tokens_list=[4], device="cpu", on_gpu=False)
    by_provider = {r["provider"]: r for r in rows}
    assert by_provider["torch-eager"]["correct"] is True
    assert by_provider["tilegen"]["correct"] is False and by_provider["tilegen"]["rel_err"] > 1e-2


@pytest.mark.parametrize("args, message", [
    (["--seqlens", "1k"], "--seqlens: expected comma-separated whole numbers of at least 1, got '1k'"),
    (["--full-seqlens", "0"], "--full-seqlens: expected comma-separated whole numbers of at least 1, got '0'"),
    (["--parts", "dispatch", "--tpe-seeds", "a"], "--tpe-seeds: expected comma-separated whole numbers of at least 0"),
    (["--full-trials", "0"], "--full-trials: expected a positive number, got 0"),
])
def test_the_tuning_benchmark_checks_its_flags_before_any_part_runs(args, message):
    result = runner.invoke(app, ["bench", "tuning", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dispatch part takes seconds; a GPU's minutes")
def test_the_tuning_benchmark_makes_its_out_folder(tmp_path, monkeypatch):
    out = tmp_path / "new" / "tuning"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "db.sqlite"))  # the benchmark points it at its own grid
    result = runner.invoke(app, ["bench", "tuning", "--parts", "dispatch", "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    assert "dispatch" in json.loads((out / "bench_tuning.json").read_text())["results"]


@pytest.mark.parametrize("name, args, message", [
    ("attention", ["--masks", "causl"], "--masks: expected causal and/or full, got 'causl'"),
    ("attention", ["--seqlens", "1k,4096"],
     "--seqlens: expected comma-separated positive whole numbers, got '1k,4096'"),
    ("attention", ["--seqlens", "0"], "--seqlens: expected comma-separated positive whole numbers, got '0'"),
    ("serving", ["--parts", "raged"], "--parts: expected parts among ragged, equal, paged, sweep-paged, got 'raged'"),
    ("serving", ["--page-sizes", "16,x"], "--page-sizes: expected comma-separated sizes among 1, 8, 16, 32, 64, 128"),
    ("serving", ["--page-sizes", "12"], "--page-sizes: expected comma-separated sizes among"),
    ("cascade", ["--cases", "64x32768"], "--cases: expected comma-separated BATCHxPREFIX+OWN"),
    ("cascade", ["--cases", "0x4096+1"], "--cases: expected comma-separated BATCHxPREFIX+OWN"),
    ("cascade", ["--configs", "fast"], "--configs: expected cascade configs such as"),
    ("mods", ["--mods", "alibi,alibbi"], "--mods: unknown alibbi; expected names from alibi, alibi+causal"),
    ("mods", ["--configs", "{"], "--configs: expected a JSON list of knob objects, got invalid JSON"),
    ("mods", ["--configs", "[1]"], "--configs: expected a JSON list of knob objects"),
    ("mods", ["--head-dim", "100"], "--head-dim: expected a multiple of 8 from 16 to 256, got 100"),
    ("mods", ["--head-dim", "264"], "--head-dim: expected a multiple of 8 from 16 to 256, got 264"),
])
def test_a_gpu_benchmark_checks_its_flags_before_any_gpu_work(name, args, message):
    result = runner.invoke(app, ["bench", name, *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_mods_benchmarks_names_are_the_mods_it_builds():
    from tilegen.bench import mods

    assert tuple(mods._mods(torch.Generator().manual_seed(0), device="cpu")) == mods.NAMES
