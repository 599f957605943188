"""A bucket's winner is timed again with its closest rivals before its row is stored
(``Tuner(confirm=...)``): one measurement moves by a few percent between moments and GPUs.

A scripted worker answers trials from a table and ``Compare`` tasks from another, so the
tests set what the first measurements and the comparison say; the last test runs a real
``Compare`` in a worker process under the interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from tilegen.cli import app
from tilegen.db import TuningDB
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_fwd import FAMILY, AttentionSpec
from tilegen.tuning import Tuner, tuner
from tilegen.tuning.measure import Compare
from tilegen.tuning.tuner import CONFIRM_ROUNDS
from tilegen.tuning.worker import Worker

SPEC = AttentionSpec(head_dim=16, dtype="fp32", mask="causal")
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
CONFIGS = FAMILY.candidates(SPEC, CPU_INTERPRETER)[:5]  # the interpreter's small grid: 9 configs


class _Scripted:
    """First measurements from ``first`` (config index -> ms), comparisons from ``again``."""

    def __init__(self, first: dict[int, float], again: dict[int, float]):
        self.first, self.again = first, again
        self.compared: list[tuple] = []

    def measure(self, task, timeout) -> dict:
        if isinstance(task, Compare):
            self.compared.append(task.configs)
            assert task.rounds == CONFIRM_ROUNDS
            return {"status": "ok", "times_ms": [self.again[CONFIGS.index(c)] for c in task.configs]}
        config = task[2]
        index = CONFIGS.index(config) if config in CONFIGS else None
        if index is None:
            return {"status": "ok", "time_ms": 9.0, "max_error": 0.0, "reason": None}
        return {"status": "ok", "time_ms": self.first[index], "max_error": 0.0, "reason": None}

    def close(self):
        pass


def _tune(tmp_path, worker, *, confirm, buckets=(16,), index=0, count=1, db_name="t.sqlite"):
    with TuningDB(tmp_path / db_name) as db, Tuner(db, CPU_INTERPRETER, sampler="grid", worker=worker, confirm=confirm,
                                                   worker_index=index, worker_count=count, compile_ahead=0) as t:
        results = t.tune_jobs([(SPEC, bucket, None) for bucket in buckets])
        trials = db.trials_for(SPEC.hash)
    return results, trials


# config 0 measured once at 1.00 ms (a lucky moment), 1 at 1.02, 2 at 1.04, 3 at 1.20, 4 at 1.30;
# timed again back to back, 1 is the fastest.
FIRST = {0: 1.00, 1: 1.02, 2: 1.04, 3: 1.20, 4: 1.30}
AGAIN = {0: 1.08, 1: 1.03, 2: 1.05, 3: 1.21, 4: 1.31}


def test_the_winner_of_the_comparison_is_stored_with_its_new_time(tmp_path):
    worker = _Scripted(FIRST, AGAIN)
    [result], trials = _tune(tmp_path, worker, confirm=2)
    # The two rivals within 12% of the best are compared with it; 1.20 ms is not a rival.
    assert [set(configs) for configs in worker.compared] == [{CONFIGS[0], CONFIGS[1], CONFIGS[2]}]
    assert result.best.config == CONFIGS[1] and result.best.time_ms == pytest.approx(1.03)
    # The trials carry the new times, so whoever reads them later finds the same winner.
    by_config = {FAMILY.config_type.from_dict(t.config): t for t in trials}
    assert by_config[CONFIGS[0]].time_ms == pytest.approx(1.08)
    assert "first measured 1 ms" in by_config[CONFIGS[0]].reason
    assert by_config[CONFIGS[3]].time_ms == pytest.approx(1.20) and by_config[CONFIGS[3]].reason is None
    with TuningDB(tmp_path / "t.sqlite") as db:
        [row] = [r for r in db.list_tuned() if r.spec_hash == SPEC.hash]
        assert FAMILY.config_type.from_dict(row.config) == CONFIGS[1] and row.time_ms == pytest.approx(1.03)
        # A later reader of the same key (the parent of --gpus collects this way) keeps it.
        with Tuner(db, CPU_INTERPRETER, sampler="grid", worker=_Scripted(FIRST, AGAIN), confirm=2) as t:
            [again] = t.collect([(SPEC, 16)])
        assert again.best.config == CONFIGS[1]
        [row] = [r for r in db.list_tuned() if r.spec_hash == SPEC.hash]
        assert FAMILY.config_type.from_dict(row.config) == CONFIGS[1]


def test_one_rival_within_12_percent_is_compared_by_default(tmp_path):
    # A first measurement 10% fast (as seen on an H200) still meets its rival; the third does not.
    worker = _Scripted({0: 1.00, 1: 1.10, 2: 1.11, 3: 1.20, 4: 1.30}, {0: 1.12, 1: 1.09, 2: 1.10, 3: 1.2, 4: 1.3})
    [result], _ = _tune(tmp_path, worker, confirm=tuner.CONFIRM_RIVALS)
    assert [set(configs) for configs in worker.compared] == [{CONFIGS[0], CONFIGS[1]}]
    assert result.best.config == CONFIGS[1] and result.best.time_ms == pytest.approx(1.09)


def test_without_confirmation_the_best_first_measurement_wins(tmp_path):
    worker = _Scripted(FIRST, AGAIN)
    [result], _ = _tune(tmp_path, worker, confirm=0)
    assert worker.compared == [] and result.best.config == CONFIGS[0]


def test_a_clear_winner_is_not_compared(tmp_path):
    worker = _Scripted({0: 1.0, 1: 1.2, 2: 1.3, 3: 1.4, 4: 1.5}, AGAIN)
    [result], _ = _tune(tmp_path, worker, confirm=2)
    assert worker.compared == [] and result.best.config == CONFIGS[0]


def test_processes_sharing_the_studies_confirm_the_buckets_in_turn(tmp_path):
    worker = _Scripted(FIRST, AGAIN)
    _tune(tmp_path, worker, confirm=2, buckets=(16, 32, 64), index=1, count=2)
    assert len(worker.compared) == 1  # the second of three buckets; the other process takes the first and third


def test_a_finished_bucket_is_confirmed_while_later_ones_are_measured(tmp_path):
    class Logged(_Scripted):
        def __init__(self, first, again):
            super().__init__(first, again)
            self.events: list[str] = []

        def measure(self, task, timeout):
            self.events.append("compare" if isinstance(task, Compare) else "trial")
            return super().measure(task, timeout)

    worker = Logged(FIRST, AGAIN)
    results, _ = _tune(tmp_path, worker, confirm=2, buckets=(16, 32, 64))
    grid = len(FAMILY.candidates(SPEC, CPU_INTERPRETER))
    # Each bucket as soon as every process has measured it (here: at once), before the next one's
    # trials: a GPU that shares the studies goes on measuring while another confirms, and none
    # is left confirming at the end while the others wait.
    assert [i for i, e in enumerate(worker.events) if e == "compare"] == [grid, 2 * grid + 1, 3 * grid + 2]
    assert all(r.best.config == CONFIGS[1] for r in results)


def test_a_failed_comparison_keeps_the_first_measurements(tmp_path):
    class Faulting(_Scripted):
        def measure(self, task, timeout):
            if isinstance(task, Compare):
                return {"status": "fault", "reason": "worker died"}
            return super().measure(task, timeout)

    [result], _ = _tune(tmp_path, Faulting(FIRST, AGAIN), confirm=2)
    assert result.best.config == CONFIGS[0] and result.best.time_ms == pytest.approx(1.00)


def test_confirmation_is_on_by_default_only_for_a_gpu_worker(tmp_path):
    with TuningDB(tmp_path / "t.sqlite") as db:
        with Tuner(db, H200, compile_ahead=0) as t:
            assert t.confirm == 1  # the runner-up
        with Tuner(db, CPU_INTERPRETER) as t:
            assert t.confirm == 0
        with Tuner(db, H200, worker=_Scripted(FIRST, AGAIN), compile_ahead=0) as t:
            assert t.confirm == 0
        with pytest.raises(ValueError, match="confirm: expected a whole number"):
            Tuner(db, H200, confirm=-1, compile_ahead=0)


def test_the_tune_command_refuses_a_negative_confirm(tmp_path):
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "t.sqlite"), "--confirm", "-1"])
    assert result.exit_code != 0
    assert "--confirm: expected a number of rivals, 0 or more, got -1" in result.output
    assert not (tmp_path / "t.sqlite").exists()


def test_a_worker_process_compares_configs_on_one_set_of_inputs():
    """On a GPU each config is replayed from a CUDA graph (measure.replayable), under the interpreter called."""
    on_gpu = torch.cuda.is_available()
    problem = FAMILY.problem(SPEC, 16, on_gpu=on_gpu)
    configs = tuple(FAMILY.candidates(SPEC, device_info() if on_gpu else CPU_INTERPRETER)[:2])
    with Worker() as worker:
        answer = worker.measure(Compare(FAMILY, problem, configs, 0, 2), timeout=300)
    assert answer["status"] == "ok", answer
    assert len(answer["times_ms"]) == 2 and all(t > 0 for t in answer["times_ms"])


# -- start-up of --gpus: what the parent does before its tune processes can start ---------------


def test_one_model_is_checked_without_cuda_where_nvml_names_one(monkeypatch):
    from tilegen.cli import tune as tune_command

    read = []
    monkeypatch.setattr(tune_command.torch.cuda, "get_device_name", lambda i: read.append(i) or f"GPU model {i}")
    monkeypatch.setattr(tune_command, "host_gpu_models", lambda: {"NVIDIA H200"})
    tune_command._check_one_model([0, 1])
    assert read == []  # every GPU of the host is one model: no CUDA context
    monkeypatch.setattr(tune_command, "host_gpu_models", lambda: None)  # NVML cannot tell: CUDA says
    with pytest.raises(typer.Exit):
        tune_command._check_one_model([0, 1])
    assert read == [0, 1]
    monkeypatch.setattr(tune_command, "host_gpu_models", lambda: {"NVIDIA H200", "NVIDIA L40S"})
    monkeypatch.setattr(tune_command.torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    tune_command._check_one_model([0, 1])  # a mixed host, but the chosen two are alike


def test_host_gpu_models_without_nvml_is_none_or_names():
    from tilegen.device import host_gpu_models

    models = host_gpu_models()
    assert models is None or all(isinstance(name, str) and name for name in models)


def test_a_planning_tuner_opens_no_studies_and_takes_no_lock(tmp_path, monkeypatch):
    from tilegen.tuning import tuner as tuner_module

    opened = []
    real = tuner_module._storage
    monkeypatch.setattr(tuner_module, "_storage", lambda db, heartbeat: opened.append(1) or real(db, heartbeat))
    worker = _Scripted(FIRST, AGAIN)
    _tune(tmp_path, worker, confirm=0)
    assert opened == [1]
    with TuningDB(tmp_path / "t.sqlite") as db, Tuner(db, CPU_INTERPRETER, sampler="grid", worker=worker,
                                                      open_studies=False) as t:
        [result] = t.collect([(SPEC, 16)])
    assert opened == [1] and result.best.config == CONFIGS[0]


@pytest.mark.gpu
def test_a_trial_is_timed_from_a_cuda_graph_of_its_launch():
    """The replay runs the launch's kernels on its tensors; a launch that synchronizes cannot be
    captured, and is then timed as it is."""
    from tilegen.tuning.measure import replayable

    x = torch.randn(1000, device="cuda")
    out = torch.full_like(x, float("nan"))

    def launch():
        torch.mul(x, 2.0, out=out)

    gpu, cpu = (SimpleNamespace(on_gpu=on_gpu, timed_from_graph=True) for on_gpu in (True, False))
    launch()
    replay = replayable(launch, gpu)
    assert replay is not launch
    x.copy_(torch.randn_like(x))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2.0)

    def synchronizing():
        out.copy_(x * float(x.sum().item() != 0.5))

    assert replayable(synchronizing, gpu) is synchronizing
    assert replayable(launch, cpu) is launch
    replayable(launch, gpu)()  # the failed capture left this thread able to capture and launch
    torch.cuda.synchronize()
