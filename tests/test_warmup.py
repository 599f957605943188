"""The background warm-up of Triton's per-process work (tilegen.triton_internals.warmup)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from triton.runtime import cache as triton_cache

from tilegen.triton_internals import gate, warmup

#: Entries of Triton's key memo once the warm-up is done: none where it steps aside, on a Triton tilegen does not know.
MEMO = 1 if gate.reason() is None else 0

_PROBE = (
    "import tilegen, tilegen.triton_internals.warmup as w; t = w._thread; "
    "print('none' if t is None else 'started'); w.wait(); "
    "from triton.runtime import cache; "
    "print(cache.triton_key.cache_info().currsize if t is not None else '-')"
)


def _probe(interpret: str) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_import_starts_the_warmup_only_when_kernels_compile():
    # A compiling process has Triton's key memoised once the warm-up is waited for (on a Triton tilegen knows).
    assert _probe("0") == ["started", str(MEMO)]
    # The interpreter compiles nothing: no thread.
    assert _probe("1") == ["none", "-"]


def test_start_is_idempotent_and_fills_tritons_memo():
    warmup.start()
    first = warmup._thread
    warmup.start()
    assert warmup._thread is first
    warmup.wait()
    assert not first.is_alive()
    if not hasattr(triton_cache.triton_key, "cache_info"):
        pytest.skip("this Triton's triton_key is not memoised with lru_cache")
    assert triton_cache.triton_key.cache_info().currsize == MEMO


def test_a_failing_warmup_is_silent(monkeypatch):
    def broken():
        raise RuntimeError("no such file")

    monkeypatch.setattr(triton_cache, "triton_key", broken)
    warmup._work()  # must not raise: the first launch computes the key itself
