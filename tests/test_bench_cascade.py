"""tilegen.bench.cascade's bookkeeping, with its GPU pieces stubbed: the providers of a case take turns, each
figure the median of its rounds; a cascade whose output disagrees with PagedDecode's is reported and not timed."""

from __future__ import annotations

import pytest
import torch

from tilegen.bench import cascade as bench


@pytest.fixture
def stubbed(monkeypatch):
    """Stubs for the GPU pieces; ``order`` records which provider each timing call ran, ``times`` scripts them."""
    order: list[str] = []
    times: dict[str, list[float]] = {}
    wrong: set[str] = set()
    expected = torch.ones(2, bench.HQ, bench.D)

    def runner(name):
        def run():
            order.append(name)
        run.provider = name
        return run

    def decode(cache, q):
        return expected, runner(f"decode-{cache}")

    def cascade(cache, q, levels, config=None):
        name = "cascade" if config is None else f"cascade {config}"
        out = expected * (2 if name in wrong else 1)
        return out, runner(name), str(config), 7, {"shared": 1.0}

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    # A cache without a prefix shares nothing, whatever its page tables say.
    monkeypatch.setattr(bench, "_cache",
                        lambda batch, prefix, own, shared, gen: "shared" if shared and prefix else "unshared")
    monkeypatch.setattr(bench.tilegen, "cascade_levels", lambda cache: ["level"] * 2)
    monkeypatch.setattr(bench, "_decode", decode)
    monkeypatch.setattr(bench, "_cascade", cascade)

    def timed(fn):
        fn()
        return times[order[-1]].pop(0)

    monkeypatch.setattr(bench, "_bench", timed)
    return order, times, wrong


def test_rounds_take_turns_and_report_each_providers_median(stubbed):
    order, times, wrong = stubbed
    times.update({"decode-shared": [5.0, 1.0, 3.0], "decode-unshared": [20.0, 40.0, 30.0], "cascade": [2.0, 9.0, 4.0]})
    wrong.add("cascade X")
    row = bench.case(2, 32, 16, ["X"], rounds=3)
    # Three providers timed (the wrong config is not), the first of them rotating each round.
    assert order == ["decode-shared", "decode-unshared", "cascade", "decode-unshared", "cascade", "decode-shared",
                     "cascade", "decode-shared", "decode-unshared"]
    assert row["decode-shared us"] == 3.0 and row["decode-unshared us"] == 30.0 and row["cascade us"] == 4.0
    assert row["cascade us rounds"] == [2.0, 9.0, 4.0]
    assert row["cascade X us"].startswith("wrong: relative error") and "cascade X us rounds" not in row
    # The ideal: the unique bytes (the prefix once, every request's own tokens) at the unshared decode's rate.
    all_bytes, unique = 2 * (32 + 16) * bench.HKV * bench.D * 4, (32 + 2 * 16) * bench.HKV * bench.D * 4
    assert row["ideal us"] == pytest.approx(30.0 * unique / all_bytes)


def test_one_round_times_each_provider_once(stubbed):
    order, times, _ = stubbed
    times.update({"decode-unshared": [8.0], "cascade": [6.0]})
    row = bench.unshared_case(2, 64)
    assert order == ["decode-unshared", "cascade"]
    assert row["decode-unshared us"] == 8.0 and row["cascade us"] == 6.0 and "cascade us rounds" not in row


def test_a_provider_that_raises_while_timed_is_reported_not_fatal(stubbed):
    order, times, _ = stubbed
    times.update({"decode-shared": [1.0, 1.0], "decode-unshared": [2.0, 2.0], "cascade": []})  # the cascade raises
    row = bench.case(2, 32, 16, [], rounds=2)
    assert row["cascade us"].startswith("IndexError") and row["decode-unshared us"] == 2.0


def test_bad_rounds_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rounds", "0"])
    assert exit_.value.code == 2 and "--rounds: expected at least 1, got 0" in capsys.readouterr().err
