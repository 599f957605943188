"""examples/decode_sweep.py: without a GPU its one tiny case runs under the interpreter and writes its JSON."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_sweep.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the sweep runs every case: minutes")
def test_the_sweep_makes_its_out_folder_and_writes_the_json_there(tmp_path):
    out = tmp_path / "new" / "sweep"
    env = {**os.environ, "OUT": str(out), "BUDGET": "60"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (case,) = json.loads((out / "decode_explore.json").read_text())
    assert case["results"] and {r["layout"] for r in case["results"]} == {"NHD", "HND"}
    # The interpreter times nothing: no bandwidth is made up from it.
    assert all(r["gbs"] is None for r in case["results"]) and set(case["peers"].values()) == {None}


def test_a_budget_that_is_no_number_is_one_error_line(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "BUDGET": "5m"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["error: BUDGET: expected a number of seconds, got '5m'"]
