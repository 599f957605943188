"""The first call's row read stays off SQLAlchemy (and the first call off Dynamo), and the cold-start benchmark runs (timings are its job, not a test's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import checkout_pythonpath

from tilegen.env import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs CPU tensors under the interpreter")


def test_a_first_call_reads_its_rows_without_importing_sqlalchemy_or_dynamo(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch, tilegen
        q = torch.randn(1, 2, 20, 32)
        tilegen.attention(q, q, q, causal=True)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("sqlalchemy", "alembic", "optuna"))
        assert not loaded, loaded
        assert "tilegen.db.store" not in sys.modules
        # Nor Dynamo, which costs seconds to import: only a call under torch.compile needs it.
        assert "torch._dynamo" not in sys.modules
        """
    )
    environment = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "TILEGEN_DB": str(tmp_path / "none.sqlite")}
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_cold_start_benchmark_runs(tmp_path):
    environment = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "TILEGEN_DB": str(tmp_path / "none.sqlite")}
    done = subprocess.run([sys.executable, "-m", "tilegen.bench.coldstart", "--runs", "1", "--ops",
                           "attention,varlen,decode"], env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for line in ("empty caches, split", "warm caches, as users call it", "read rows", "first call", "second call",
                 "varlen: warm caches", "decode: empty caches"):
        assert line in done.stdout
    bad = subprocess.run([sys.executable, "-m", "tilegen.bench.coldstart", "--ops", "prefill"], env=environment,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--ops: expected names among attention, varlen, decode" in bad.stderr
