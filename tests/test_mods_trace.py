"""What a mod's cached trace depends on, and the host's range checks of its indices: no kernel runs here.

A trace writes the mod's Python numbers into its text and keeps the tensors it reached, so it is redone
whenever any of them changes, however the mod reaches it (closure, global, default, a helper function, an
attribute, a container, an ``nn.Module``); an index whose range the host can bound is checked at every call.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from tilegen.mods import library
from tilegen.mods.trace import CallRanges, bind_mods, trace, traced

RANGES = CallRanges(b=1, h=2, q_idx=33, kv_idx=33)


def _bound_tensor(fn, kind="score_mod"):
    (tensor,) = traced(fn, kind).tensors
    return tensor


def test_a_changed_number_is_traced_again():
    width = 4

    def band(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= width

    assert "le(v0,4)" in traced(band, "mask_mod").canonical
    width = 9  # noqa: F841  (read by band through its closure)
    assert "le(v0,9)" in traced(band, "mask_mod").canonical


_SCALE = 2.0


def test_a_changed_global_number_is_traced_again():
    global _SCALE

    def scaled(score, b, h, q_idx, kv_idx):
        return score * _SCALE

    try:
        assert "mul(score,2.0)" in traced(scaled, "score_mod").canonical
        _SCALE = 3.0
        assert "mul(score,3.0)" in traced(scaled, "score_mod").canonical
    finally:
        _SCALE = 2.0


def test_a_tensor_replaced_behind_an_attribute_a_container_or_a_helper_is_the_one_bound():
    config = types.SimpleNamespace(slopes=torch.rand(2))
    tables = [torch.rand(2)]
    helper_table = {"t": torch.rand(2)}

    def lookup(h):
        return helper_table["t"][h]

    mods = [lambda s, b, h, q, k: s + config.slopes[h], lambda s, b, h, q, k: s + tables[0][h],
            lambda s, b, h, q, k: s + lookup(h)]
    for mod in mods:
        _bound_tensor(mod)
    config.slopes, tables[0], helper_table["t"] = torch.rand(2), torch.rand(3), torch.rand(2)
    assert _bound_tensor(mods[0]) is config.slopes
    assert _bound_tensor(mods[1]) is tables[0]
    assert _bound_tensor(mods[2]) is helper_table["t"]


def test_a_module_mod_binds_its_current_parameter():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(2, 4))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h, kv_idx % 4]

    module = Bias()
    assert _bound_tensor(module) is module.bias
    module.bias = torch.nn.Parameter(torch.ones(2, 4))
    assert _bound_tensor(module) is module.bias
    with pytest.raises(ValueError, match=r"'self\.bias' \(shape \(2, 4\)\), dim 0: h ranges over \[0, 2\]"):
        bind_mods(module, None, torch.device("cpu"), RANGES._replace(h=3))


def test_a_mod_reaching_an_object_it_cannot_follow_is_traced_at_every_call_with_one_warning():
    class Slotted:
        __slots__ = ("slopes",)

    holder = Slotted()
    holder.slopes = torch.rand(2)

    def mod(score, b, h, q_idx, kv_idx):
        return score + holder.slopes[h]

    with pytest.warns(UserWarning, match="traced again at every call"):
        first = traced(mod, "score_mod")
    holder.slopes = torch.rand(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per function
        assert traced(mod, "score_mod").tensors[0] is holder.slopes is not first.tensors[0]


def test_defaults_are_read_as_captured_values():
    table = torch.rand(2)
    mods = [lambda s, b, h, q, k, t=table: s + t[h], lambda s, b, h, q, k, w=4: s * w]
    assert trace(mods[0], "score_mod").names == ("t",) and trace(mods[0], "score_mod").tensors[0] is table
    assert "mul(score,4)" in trace(mods[1], "score_mod").canonical
    assert "le(v0,3)" in trace(lambda b, h, q, k, w=3: q - k <= w, "mask_mod").canonical
    with pytest.raises(TypeError, match="expected 4 arguments"):
        trace(lambda b, h, q, k, w: q - k <= w, "mask_mod")  # an extra argument without a default


@pytest.mark.parametrize("index, size, message", [
    (lambda q, k: k - q + 32, 33, r"kv_idx - q_idx \+ 32 ranges over \[0, 64\], outside \[0, 32\]"),
    (lambda q, k: q * 1, 20, r"q_idx \* 1 ranges over \[0, 32\], outside \[0, 19\]"),
    (lambda q, k: torch.clamp(k - q, -8, 8) + 8, 16, r"ranges over \[0, 16\], outside \[0, 15\]"),
    (lambda q, k: torch.abs(k - q) // 4, 8, r"ranges over \[0, 8\], outside \[0, 7\]"),
    # Each branch over the positions that take it: q_idx where q_idx > kv_idx (1 to 32), kv_idx + 40 elsewhere.
    (lambda q, k: torch.where(q > k, q, k + 40), 70, r"ranges over \[1, 72\], outside \[0, 69\]"),
    (lambda q, k: (q > k).int() * 20, 12, r"\(q_idx > kv_idx\) \* 20 ranges over \[0, 20\], outside \[0, 11\]"),
    (lambda q, k: (k - q) % 5 + 29, 33, r"ranges over \[29, 33\], outside \[0, 32\]"),
], ids=["relative", "scaled", "clamped", "bucketed", "where", "bool", "mod"])
def test_an_index_the_host_can_bound_is_checked_over_every_position(index, size, message):
    rel = torch.rand(2, size)

    def mod(score, b, h, q_idx, kv_idx):
        return score + rel[h, index(q_idx, kv_idx)]

    with pytest.raises(ValueError, match=r"score_mod: captured tensor 'rel' .*dim 1: .*" + message):
        bind_mods(mod, None, torch.device("cpu"), RANGES)
    rel = torch.rand(2, 80)  # large enough for every position: accepted
    bind_mods(mod, None, torch.device("cpu"), RANGES)


def test_a_negative_index_is_refused():
    rel = torch.rand(2, 80)

    def mod(score, b, h, q_idx, kv_idx):
        return score + rel[h, kv_idx - q_idx + 16]

    with pytest.raises(ValueError, match=r"kv_idx - q_idx \+ 16 ranges over \[-16, 48\], outside \[0, 79\]"):
        bind_mods(mod, None, torch.device("cpu"), RANGES)


def test_indices_in_range_and_unbounded_ones_pass():
    rel = torch.rand(2, 65)
    ids = torch.randint(0, 4, (33,))
    table = torch.rand(2, 4)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[h, kv_idx - q_idx + 32]

    def through_a_table(score, b, h, q_idx, kv_idx):  # the index is a value read from a tensor: the kernel masks it
        return score + table[h, ids[kv_idx]]

    bind_mods(relative, None, torch.device("cpu"), RANGES)
    bind_mods(through_a_table, None, torch.device("cpu"), RANGES)
    bind_mods(library.relative_bias(torch.rand(2, 32)), None, torch.device("cpu"), RANGES)
    # No key: nothing reads the tensor, whatever the index.
    bind_mods(relative, None, torch.device("cpu"), RANGES._replace(kv_idx=0))


@pytest.mark.parametrize("band, ok", [((None, 0), True), ((None, None), False), ((-3, 0), True), ((None, 2), False)],
                         ids=["causal", "no-mask", "window", "window-right"])
def test_positions_a_built_in_mask_drops_are_not_checked(band, ok):
    """A causal relative bias reads bias[q_idx - kv_idx] at kept positions only (kv_idx <= q_idx): accepted under
    causal=True, refused without it (a negative index at the positions above the diagonal)."""
    bias = torch.rand(2, 33)

    def causal_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx]

    ranges = RANGES._replace(band=band)
    if ok:
        bind_mods(causal_bias, None, torch.device("cpu"), ranges)
    else:
        with pytest.raises(ValueError, match=r"q_idx - kv_idx ranges over \[-\d+, 32\]"):
            bind_mods(causal_bias, None, torch.device("cpu"), ranges)


def test_a_where_is_checked_branch_by_branch():
    """where(q_idx >= kv_idx, q_idx - kv_idx, 0) never reads a negative index: each branch is bounded over the
    positions that take it. A condition the host cannot split on leaves the index to the kernel's masked read."""
    table = torch.rand(2, 33)

    def split(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.where(q_idx >= kv_idx, q_idx - kv_idx, 0)]

    def unsplittable(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.where(q_idx + kv_idx > 40, q_idx - kv_idx, 0)]

    bind_mods(split, None, torch.device("cpu"), RANGES)
    bind_mods(unsplittable, None, torch.device("cpu"), RANGES)
    with pytest.raises(ValueError, match=r"where\(q_idx >= kv_idx, q_idx - kv_idx, 0\) ranges over \[0, 33\]"):
        bind_mods(split, None, torch.device("cpu"), RANGES._replace(q_idx=34, kv_idx=34))


def test_the_cache_keeps_no_mod_alive():
    """Mods made at every step (a forward that builds its mod) are dropped with their captured tensors."""
    import gc
    import weakref

    refs = []
    for _ in range(5):
        table = torch.rand(2)

        def mod(score, b, h, q_idx, kv_idx, table=table):
            return score + table[h]

        traced(mod, "score_mod")
        refs.append((weakref.ref(mod), weakref.ref(table)))
    del mod, table
    gc.collect()
    assert all(f() is None and t() is None for f, t in refs)


def test_a_bound_method_is_traced_once_per_instance():
    class Layer:
        def __init__(self):
            self.slopes = torch.rand(2)

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.slopes[h]

    layer = Layer()
    first = traced(layer.score_mod, "score_mod")  # a new method object at every read of layer.score_mod
    assert traced(layer.score_mod, "score_mod") is first and first.names == ("self.slopes",)
    layer.slopes = torch.rand(3)
    assert traced(layer.score_mod, "score_mod").tensors[0] is layer.slopes


def test_a_buffer_no_code_reads_does_not_trace_again():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(2))
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h]

    module = Bias()
    first = traced(module, "score_mod")
    with torch.no_grad():
        module.steps += 1
        module.bias.add_(1.0)  # handed to the kernel at every call: its values need no new trace
    assert traced(module, "score_mod") is first


def test_a_parameter_a_mod_closes_over_is_a_captured_tensor():
    slopes = torch.nn.Parameter(torch.rand(2))
    mod = trace(library.alibi(slopes), "score_mod")
    assert mod.tensors[0] is slopes and mod.names == ("slopes",)


def test_numpy_and_enum_numbers_are_written_as_numbers():
    import enum

    import numpy

    class Width(enum.IntEnum):
        NARROW = 4

    text = trace(lambda s, b, h, q, k: s * numpy.int64(3) + (k % numpy.int32(5)) + Width.NARROW, "score_mod").canonical
    assert "mul(score,3)" in text and "mod(kv_idx,5)" in text and ",4)" in text


def test_a_ragged_batch_of_unknown_diagonals_leaves_indices_of_both_positions_to_the_kernel():
    """Sequences of a ragged batch have diagonals of their own, which the host does not know: an index reading
    both positions is not checked (the kernel masks its reads); one reading a single position still is."""
    rel = torch.rand(8)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[kv_idx - q_idx + 3]

    def shifted(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - 3]

    ranges = CallRanges(b=2, h=2, q_idx=8, kv_idx=8, band="unknown")
    bind_mods(relative, None, torch.device("cpu"), ranges)
    with pytest.raises(ValueError, match=r"q_idx - 3 ranges over \[-3, 4\]"):
        bind_mods(shifted, None, torch.device("cpu"), ranges)


def test_class_attributes_strings_and_unhashable_instances():
    """A class the mod names (Config.scale), an attribute read with getattr and a string, a bound method of an
    unhashable instance (a dataclass): changes are seen, and the last is traced once."""
    import dataclasses

    class Config:
        scale = 2.0

    holder = types.SimpleNamespace(table=torch.rand(2))

    def by_class(score, b, h, q_idx, kv_idx):
        return score * Config.scale

    def by_string(score, b, h, q_idx, kv_idx):
        return score + getattr(holder, "table")[h]

    assert "mul(score,2.0)" in traced(by_class, "score_mod").canonical
    Config.scale = 5.0
    assert "mul(score,5.0)" in traced(by_class, "score_mod").canonical
    traced(by_string, "score_mod")
    holder.table = torch.rand(2)
    assert traced(by_string, "score_mod").tensors[0] is holder.table

    @dataclasses.dataclass
    class Layer:  # eq=True: no __hash__
        slopes: torch.Tensor

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.slopes[h]

    layer = Layer(torch.rand(2))
    assert traced(layer.score_mod, "score_mod") is traced(layer.score_mod, "score_mod")


def test_a_module_mod_reads_a_submodules_parameter():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = torch.nn.Module()
            self.sub.bias = torch.nn.Parameter(torch.rand(2))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.sub.bias[h]

    module = Outer()
    assert traced(module, "score_mod").tensors[0] is module.sub.bias


def _scale_of(config):
    return config.scale


def test_an_attribute_a_helper_reads_of_an_object_the_mod_hands_it():
    config = types.SimpleNamespace(scale=2.0)

    def mod(score, b, h, q_idx, kv_idx):
        return score * _scale_of(config)

    assert "mul(score,2.0)" in traced(mod, "score_mod").canonical
    config.scale = 7.0
    assert "mul(score,7.0)" in traced(mod, "score_mod").canonical


@pytest.mark.parametrize("bounds", [{"min": "t", "max": 1.0}, {"min": -1.0, "max": "t"}])
def test_a_clamp_with_a_tensor_bound_beside_a_number_says_how_to_write_it(bounds):
    """torch reads such bounds as numbers (calling .item() on the tensor); the error says so and what to write."""
    t = torch.randn(4)

    def mod(score, b, h, q_idx, kv_idx):
        return torch.clamp(score, **{key: t[kv_idx % 4] if value == "t" else value for key, value in bounds.items()})

    with pytest.raises(ValueError, match=r"clamp: one bound is a tensor and the other a number.*clamp one side at"):
        trace(mod, "score_mod")
