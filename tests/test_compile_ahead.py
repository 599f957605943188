"""Compile ahead (``tilegen.tuning.compile_ahead``): a bucket's configs compiled into Triton's cache
while the worker measures, so the worker's JIT finds them there.

The cache round trip runs in processes of their own, compiled for sm90 with no GPU
(``compile_ahead_check.py`` on ``fake_cuda``); the tuner's side (which configs, in which
order, and never under the interpreter) runs here with a stand-in pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import optuna
import pytest
import torch

from tilegen.db import TuningDB
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import AttentionSpec
from tilegen.triton_internals import gate
from tilegen.tuning import compile_ahead, tuner
from tilegen.tuning.tuner import Tuner

SPEC = AttentionSpec(head_dim=16, dtype="fp32", mask="causal")
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
SCRIPT = Path(__file__).with_name("compile_ahead_check.py")


def _run(cache: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Triton's FP-fusion default turned off, as 3.10 turns it (from 3.9 on, where Triton reads this): the pool's
    # compiles must pass the options the worker's launches pass (triton_internals.OPTIONS), or it finds none.
    env.update(TRITON_CACHE_DIR=str(cache / "triton"), TILEGEN_CACHE_DIR=str(cache / "tilegen"),
               TILEGEN_DB=str(cache / "tuning.sqlite"), TRITON_DEFAULT_FP_FUSION="0")
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in (cache / "triton").rglob("*")}


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the fake driver stands in for a GPU only where there is none")
    ahead_dir, cold_dir = tmp_path_factory.mktemp("ahead"), tmp_path_factory.mktemp("cold")
    ahead = _run(ahead_dir, "ahead", "2")
    before = _entries(ahead_dir)
    warm = _run(ahead_dir, "launch")
    cold = _run(cold_dir, "launch")
    return ahead, warm, cold, before, _entries(ahead_dir)


def test_the_worker_launch_finds_every_kernel_the_pool_compiled(rounds):
    ahead, warm, cold, before, after = rounds
    if gate.reason() is not None:
        # A Triton whose internals tilegen does not know: no process, and the launch compiles each kernel.
        assert ahead["started"] == [] and ahead["reports"] == []
        assert warm["built"] == cold["built"] >= 3 and warm["launches"] == cold["launches"]
        return
    assert ahead["started"] == ["fork"]
    # The first config of each bucket was waited for and compiled; the third (broken), which no
    # process took up at once, was not waited for; waiting kept every report for ``reports``.
    assert ahead["waited"] == [[True, False], [True, False]]
    assert len(ahead["reports"]) == 6
    assert sum(status == "ok" for _, _, status, _ in ahead["reports"]) == 4
    # Without the pool the launches compile (the two decode configs differ in the split count only: one kernel).
    assert cold["built"] >= 3
    assert warm["built"] == 0, "the launch compiled a kernel the pool should have left in the cache"
    assert after == before, "the launch added entries to Triton's cache"
    assert warm["launches"] == cold["launches"]  # the same kernels, grids and arguments as without the pool
    assert all(warm["launches"][i] != "[]" for i in (0, 1, 3, 4))


def test_a_config_that_fails_to_compile_in_the_pool_is_left_to_the_worker(rounds):
    ahead, warm, cold, _, _ = rounds
    if gate.reason() is not None:  # no pool on this Triton: the launch meets each error itself
        assert warm["errors"] == cold["errors"] and [e for _, e in cold["errors"]] == ["AssertionError"] * 2
        return
    failed = [(config, status) for _, config, status, _ in ahead["reports"] if status != "ok"]
    assert len(failed) == 2 and all("num_warps" in status for _, status in failed)
    # The pool carried on with the next configs, and the launch meets the error it would meet anyway.
    assert warm["errors"] == cold["errors"] == [[config, "AssertionError"] for config, _ in failed]


def test_a_compile_process_refuses_torch_compute_but_allocates():
    guard = compile_ahead._allocate_only()
    x = torch.ones(4, 4)
    with guard:
        y = torch.empty(8, 4).view(4, 8).permute(1, 0)[1:]
        x.new_empty(3)
        with pytest.raises(compile_ahead._Refused):
            x + 1
        with pytest.raises(compile_ahead._Refused):
            torch.arange(4)
    assert y.shape == (7, 4)


def test_a_gpu_bucket_too_large_for_a_compile_process_is_left_to_the_worker(monkeypatch):
    class Props:
        total_memory = 141 * 10**9

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    problem = ATTENTION_FWD.problem(AttentionSpec(head_dim=128, dtype="bf16"), 4096, on_gpu=True)
    compile_ahead._check_memory(problem)  # a prefill bucket's inputs: well under the share
    huge = type("Huge", (), {"on_gpu": True, "bytes_moved": lambda self: 10**10})()
    with pytest.raises(compile_ahead._Refused, match="exceed 2% of the GPU's 141 GB"):
        compile_ahead._check_memory(huge)
    cpu = type("Cpu", (), {"on_gpu": False, "bytes_moved": lambda self: 10**13})()
    compile_ahead._check_memory(cpu)  # the interpreter's buckets hold no GPU memory


class _Pool:
    """Records what the tuner hands the compile pool."""

    made: ClassVar[list] = []

    def __init__(self, processes, *, after=None):
        self.processes = processes
        self.buckets, self.ended, self.closed, self.started = [], 0, False, False
        self.capability = None
        self.waited = []
        _Pool.made.append(self)

    def target(self, capability):
        self.capability = capability

    def start(self, fork=False):
        self.started = True

    def bucket(self, family, problem, configs):
        self.buckets.append((problem.spec, list(configs)))

    def end_bucket(self):
        self.ended += 1

    def wait(self, config):
        self.waited.append((len(self.buckets), config))
        return True

    def close(self):
        self.closed = True


class _Scripted:
    def __init__(self):
        self.measured = []

    def measure(self, task, timeout) -> dict:
        self.measured.append(task[2])
        return {"status": "ok", "time_ms": 1.0 + len(self.measured), "max_error": 0.0, "reason": None}

    def close(self):
        pass


@pytest.mark.parametrize("sampler", ["grid", "tpe"])
def test_the_tuner_hands_the_pool_each_bucket_likeliest_first(tmp_path, monkeypatch, sampler):
    monkeypatch.setattr(tuner, "CompileAhead", _Pool)
    _Pool.made.clear()
    family = ATTENTION_FWD
    feasible = family.candidates(SPEC, H200)
    worker = _Scripted()
    with TuningDB(tmp_path / "tuning.sqlite") as db, Tuner(db, H200, sampler=sampler, trials=3, worker=worker,
                                                           compile_ahead=2) as t:
        t.tune_many(SPEC, [64, 128])
    pool = _Pool.made[-1]
    assert pool.processes == 2 and pool.started and pool.closed and pool.ended == 2
    assert pool.capability == (9, 0)  # what its processes compile for, without asking CUDA
    # Only the first trial waits for its config's compile: every later one finds its config compiled ahead.
    assert pool.waited == [(1, worker.measured[0])]
    assert [spec for spec, _ in pool.buckets] == [SPEC, SPEC]
    first, second = (configs for _, configs in pool.buckets)
    assert sorted(map(str, first)) == sorted(map(str, feasible))  # every feasible config, once
    assert len(second) == len(feasible)
    if sampler == "tpe":
        assert first[0] == family.default_config(SPEC, H200, 64)
        assert second[0] == family.default_config(SPEC, H200, 128)
        # The first bucket's best (the scripted worker's first answer is its fastest) is in the warm start.
        assert worker.measured[0] in second[:2]
    else:
        # The grid's own order: what the worker measures first is what was compiled first.
        assert first[:3] == worker.measured[:3]
        assert second[:3] == worker.measured[3:6]


@pytest.mark.parametrize("seed", [0, 7])
def test_the_grid_order_is_the_order_optuna_hands_out(seed):
    feasible = ATTENTION_FWD.candidates(SPEC, H200)
    space = tuner._Choices(feasible)
    study = optuna.create_study(sampler=space.sampler(seed))
    asked = [space.suggest(study.ask()) for _ in range(len(feasible))]
    assert asked == space.order(seed, [], feasible)
    assert asked != feasible  # shuffled, so a list-order pool would compile the wrong ones first
    # Three configs measured: the rest keep their order; two pools share it in turns.
    rest = space.order(seed, [], [c for c in feasible if c not in asked[:3]])
    assert rest == asked[3:]
    zero, one = tuner._Choices.share(rest, 0, 2), tuner._Choices.share(rest, 1, 2)
    assert zero[:2] == [rest[0], rest[2]] and one[:2] == [rest[1], rest[3]]
    assert sorted(map(str, zero)) == sorted(map(str, one)) == sorted(map(str, rest))


def test_no_pool_under_the_interpreter_or_for_a_worker_that_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tuner, "CompileAhead", _Pool)
    monkeypatch.setenv(compile_ahead.ENV, "3")
    _Pool.made.clear()
    with TuningDB(tmp_path / "tuning.sqlite") as db:
        with Tuner(db, CPU_INTERPRETER, worker=_Scripted(), compile_ahead=4):
            pass
        with Tuner(db, H200, worker=_Scripted()):
            pass
        with Tuner(db, H200, worker=_Scripted(), compile_ahead=4):
            pass
    assert [p.processes for p in _Pool.made] == [0, 0, 4]


def test_default_processes(monkeypatch):
    monkeypatch.setenv(compile_ahead.ENV, "5")
    assert compile_ahead.default_processes(share=4) == 5  # set by hand: per tune process
    monkeypatch.setenv(compile_ahead.ENV, "0")
    assert compile_ahead.default_processes() == 0
    monkeypatch.delenv(compile_ahead.ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert compile_ahead.default_processes() == 8
    assert compile_ahead.default_processes(share=2) == 8
    assert compile_ahead.default_processes(share=8) == 2
    monkeypatch.setenv(compile_ahead.ENV, "many")
    assert compile_ahead.default_processes(share=8) == 2


def test_an_empty_pool_does_nothing():
    with compile_ahead.CompileAhead(0) as pool:
        pool.bucket(ATTENTION_FWD, ATTENTION_FWD.problem(SPEC, 64, on_gpu=False), ATTENTION_FWD.candidates(SPEC, H200))
        pool.end_bucket()
        assert pool.reports() == [] and not pool._procs


@pytest.mark.parametrize("flag, processes", [([], None), (["--compile-ahead", "0"], 0), (["--compile-ahead", "3"], 3)])
def test_the_tune_command_hands_its_compile_ahead_option_to_the_tuner(tmp_path, monkeypatch, flag, processes):
    from typer.testing import CliRunner

    from tilegen.cli import app
    from tilegen.cli import tune as tune_command

    seen, options = [], []
    init = Tuner.__init__
    counted = tune_command.compile_processes

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("compile_ahead"))
        init(self, *args, **kwargs)

    def counting(option):
        options.append(option)
        return counted(option)

    monkeypatch.setattr(Tuner, "__init__", recording)
    monkeypatch.setattr(tune_command, "compile_processes", counting)
    result = CliRunner().invoke(app, ["tune", "--preset", "default", "--sizes", "16", "--trials", "1",
                                      "--db", str(tmp_path / "t.sqlite"), *flag])
    assert result.exit_code == 0, result.output
    assert options == [processes]
    # The command starts the pool itself, before it touches CUDA, and hands it over: the option's processes on a
    # GPU, none under the interpreter or on a Triton whose internals compile-ahead does not know.
    from tilegen.triton_internals import compile_only

    (pool,) = seen
    expected = 0 if compile_only.support() is not None else counted(processes)
    assert isinstance(pool, compile_ahead.CompileAhead) and pool.processes == expected


@pytest.mark.parametrize("option, processes", [(None, 5), (0, 0), (3, 3)])
def test_a_one_process_tune_compiles_ahead_with_its_option_on_a_gpu_only(monkeypatch, option, processes):
    from tilegen.cli import tune as tune_command

    monkeypatch.setenv(compile_ahead.ENV, "5")
    monkeypatch.setattr(tune_command.env, "interpreting", lambda: False)
    assert tune_command.compile_processes(option) == processes
    monkeypatch.setattr(tune_command.env, "interpreting", lambda: True)
    assert tune_command.compile_processes(option) == 0


@pytest.mark.parametrize("sampler", ["grid", "tpe"])
def test_processes_sharing_a_study_compile_ahead_from_their_own_share_of_the_configs(tmp_path, monkeypatch, sampler):
    monkeypatch.setattr(tuner, "CompileAhead", _Pool)
    _Pool.made.clear()
    orders = []
    for index in range(2):
        with TuningDB(tmp_path / f"tuning{index}.sqlite") as db, Tuner(
                db, H200, sampler=sampler, trials=1, worker=_Scripted(), compile_ahead=2,
                worker_index=index, worker_count=2) as t:
            t.tune_many(SPEC, [64])
        orders.append(list(map(str, _Pool.made[-1].buckets[0][1])))
    first, second = orders
    assert sorted(first) == sorted(second) and len(set(first)) == len(first)
    half = len(first) // 2
    if sampler == "tpe":
        assert second == first[half:] + first[:half]  # the second process starts halfway down the list
        assert first[0] == str(ATTENTION_FWD.default_config(SPEC, H200, 64))
    else:
        # The grid comes due in turns: each process compiles every other config of its order first.
        merged = [None] * len(first)
        merged[::2], merged[1::2] = first[:len(first) - half], second[:half]
        feasible = ATTENTION_FWD.candidates(SPEC, H200)
        assert merged == list(map(str, tuner._Choices(feasible).order(0, [], feasible)))


def test_a_gpu_bucket_builds_on_meta_tensors_without_cuda_and_a_paged_one_falls_back():
    from tilegen.families.attention_decode import FAMILY as ATTENTION_DECODE
    from tilegen.families.attention_decode.spec import DecodeSpec

    problem = ATTENTION_FWD.problem(AttentionSpec(head_dim=128, dtype="bf16", mask="causal"), 4096, on_gpu=True)
    generator = torch.Generator
    with compile_ahead._OnMeta():
        inputs = problem.inputs(0)
        outputs = problem.outputs(inputs)
        gen = torch.Generator("cuda")  # the Problems' seeded generators: CPU ones here
    assert torch.Generator is generator and gen.device.type == "cpu"
    tensors = [*inputs, *(t for t in outputs if t is not None)]
    assert {t.device.type for t in tensors} == {"meta"}
    # What Triton specializes on besides alignment: the GPU bucket's shapes, dtypes and strides.
    q, k, v = inputs
    assert q.shape == (problem.batch, problem.heads_q, 4096, 128) and k.shape == v.shape == \
        (problem.batch, problem.heads_kv, 4096, 128)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (q, k, v, outputs[0]))
    spec = DecodeSpec(head_dim=64, q_per_kv=4, dtype="bf16", page_size=16)
    paged = ATTENTION_DECODE.problem(spec, ATTENTION_DECODE.buckets.pack(256, 4), on_gpu=True)
    with pytest.raises(RuntimeError, match="meta"), compile_ahead._OnMeta():
        paged.inputs(0)  # its page table is built from values, which meta tensors do not hold
    assert torch.Generator is generator
    with compile_ahead._OnMeta():
        placeholders = paged.placeholder_inputs()  # what compile-ahead builds: the buffers alone
    assert {t.device.type for t in placeholders.values() if isinstance(t, torch.Tensor)} == {"meta"}
    assert placeholders["k"].shape == (4 * 256 // 16 + 3, 16, paged.heads_kv, 64)


@pytest.mark.parametrize("k_lens", [(0, 1, 17, 1000), (16, 15), (1,), (33, 0, 0, 64, 5)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_placeholders_have_the_inputs_shapes_dtypes_and_strides(k_lens, page_size):
    """A compile specializes on these (and on alignment and the int arguments, which the launch
    computes from the lengths alone), so the kernels compiled from placeholders are the ones a
    launch on real inputs finds."""
    from tilegen.families.attention_decode import FAMILY as ATTENTION_DECODE
    from tilegen.families.attention_decode.spec import DecodeSpec

    spec = DecodeSpec(head_dim=64, q_per_kv=4, dtype="bf16", page_size=page_size)
    problem = ATTENTION_DECODE.problem(spec, ATTENTION_DECODE.buckets.pack(1024, 4), on_gpu=False, k_lens=k_lens)

    def shape_of(inputs):
        return {name: (tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t
                for name, t in inputs.items()}

    assert shape_of(problem.placeholder_inputs()) == shape_of(problem.inputs(0))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_attention_buckets_meta_inputs_import_nothing_more(dtype):
    """Random tensors on meta run torch's Python reference code, whose first call imports sympy:
    seconds per compile process where packages ship without bytecode, in the first bucket's
    path. An attention bucket's inputs are random and NaN-filled tensors only, so building them
    on meta must import nothing; a fresh interpreter shows it."""
    code = f"""
import sys, torch, torch.utils._device  # the latter is what _OnMeta itself uses
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD, AttentionSpec
from tilegen.tuning.compile_ahead import _OnMeta
from tilegen.triton_internals import warmup
problem = ATTENTION_FWD.problem(AttentionSpec(head_dim=128, dtype="{dtype}", mask="causal", q_per_kv=4), 8192, on_gpu=True)
warmup.wait()  # on a GPU the import's warm-up thread imports Triton's modules meanwhile
before = set(sys.modules)
with _OnMeta():
    inputs = problem.inputs(0)
    outputs = problem.outputs(inputs)
assert {{t.device.type for t in (*inputs, *outputs) if t is not None}} == {{"meta"}}
print(sorted(set(sys.modules) - before))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_random_tensors_on_meta_keep_their_shape_and_dtype():
    with compile_ahead._OnMeta():
        gen = torch.Generator("cuda").manual_seed(0)
        made = [
            torch.randn(2, 3, generator=gen, device="cuda", dtype=torch.bfloat16), torch.randn((2, 3)),
            torch.randn(torch.Size([4])), torch.randn(size=(5,)), torch.rand(3, 4),
            torch.randint(0, 5, (2, 2), generator=gen), torch.randint(7, (3,)),
            torch.randint(0, 5, size=(6,), dtype=torch.int32),
            torch.randn_like(torch.empty(3, 2, dtype=torch.float16)), torch.randn(()),
        ]
    assert [(t.device.type, tuple(t.shape), t.dtype) for t in made] == [
        ("meta", (2, 3), torch.bfloat16), ("meta", (2, 3), torch.float32), ("meta", (4,), torch.float32),
        ("meta", (5,), torch.float32), ("meta", (3, 4), torch.float32), ("meta", (2, 2), torch.int64),
        ("meta", (3,), torch.int64), ("meta", (6,), torch.int32), ("meta", (3, 2), torch.float16),
        ("meta", (), torch.float32),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_prefill_placeholders_have_the_inputs_shapes_dtypes_and_strides(page_size):
    """The ragged and paged prefill family builds its paged buffers as decode does: from the
    lengths alone, so on the meta device too."""
    from tilegen.families.attention_varlen import FAMILY as ATTENTION_VARLEN
    from tilegen.families.attention_varlen import VarlenAttentionSpec

    spec = VarlenAttentionSpec(head_dim=64, q_per_kv=2, dtype="bf16", mask="causal", kv_layout="paged",
                               page_size=page_size)
    problem = ATTENTION_VARLEN.problem(spec, 64, on_gpu=False, k_lens=(0, 1, 17, 40), q_lens=(0, 1, 9, 40))

    def shape_of(inputs):
        return {name: (tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t
                for name, t in inputs.items()}

    assert shape_of(problem.placeholder_inputs()) == shape_of(problem.inputs(0))
    with compile_ahead._OnMeta():
        placeholders = problem.placeholder_inputs()
    assert {t.device.type for t in placeholders.values() if isinstance(t, torch.Tensor)} == {"meta"}


@pytest.mark.parametrize("page_size", [1, 16])
def test_append_placeholders_have_the_inputs_shapes_dtypes_and_strides(page_size):
    """kv_append's placeholders are sized from the lengths alone, so its compile-ahead needs no GPU."""
    import dataclasses

    from tilegen.families.kv_append import FAMILY as KV_APPEND
    from tilegen.families.kv_append.spec import KVAppendSpec

    spec = KVAppendSpec(head_dim=64, dtype="bf16", page_size=page_size)
    problem = KV_APPEND.problem(spec, KV_APPEND.buckets.of(64), on_gpu=False)

    def shape_of(inputs):
        return {field.name: (tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t
                for field in dataclasses.fields(inputs) for t in [getattr(inputs, field.name)]}

    assert shape_of(problem.placeholder_inputs()) == shape_of(problem.inputs(0))
    with compile_ahead._OnMeta():
        placeholders = problem.placeholder_inputs()
        outputs = problem.outputs(placeholders)
    tensors = [getattr(placeholders, f.name) for f in dataclasses.fields(placeholders)] + list(outputs)
    assert {t.device.type for t in tensors if isinstance(t, torch.Tensor)} == {"meta"}
