"""The heuristic defaults on GPUs with less shared memory than Hopper: a rule's config the device cannot run (its
family's ``feasible`` says why) gives way to the nearest feasible config of the search space, so an untuned call
on an A100 or an sm86/sm89 card compiles. No kernel runs here."""

from __future__ import annotations

import dataclasses

import pytest

from tilegen.device import DeviceInfo
from tilegen.families import registry

A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80 << 30, 166912)
RTX_4090 = DeviceInfo("NVIDIA GeForce RTX 4090", (8, 9), 128, 24 << 30, 101376)
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 80 << 30, 232448)
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
H200_LARGER_SMEM = dataclasses.replace(H200, smem_bytes=1 << 20)

FAMILIES = {family.name: family for family in registry.families()}


def _specs():
    """Each family's presets at the head dims and dtypes a model uses, where the spec has those fields."""
    for family in FAMILIES.values():
        for preset in family.presets.values():
            for head_dim in (64, 96, 128, 192, 256):
                for dtype in ("bf16", "fp32"):
                    changes = {name: value for name, value in (("head_dim", head_dim), ("dtype", dtype))
                               if hasattr(preset, name)}
                    try:
                        yield family, dataclasses.replace(preset, **changes)
                    except (TypeError, ValueError):  # a preset of fixed dims (a V dim of its own, a page size)
                        continue


@pytest.mark.parametrize("device", [A100, RTX_4090], ids=lambda d: d.name)
def test_every_spec_has_a_config_and_a_default_that_fit(device):
    """fp32 past head dim 128 included: the spaces sized on the H200 held no config for it on these GPUs, and its
    default asked 192 KiB of an A100's 163 (base.with_smaller)."""
    unfit, empty = [], []
    for family, spec in _specs():
        if not family.candidates(spec, device):
            empty.append(spec.name)
        for largest, config in family.fitted_default_rule(spec, device):
            reason = family.feasible(spec, config, device)
            if reason is not None:
                unfit.append(f"{spec.name} up to {largest}: {config} ({reason})")
    assert not empty, f"no config fits: {empty[:10]}"
    assert not unfit, "\n".join(unfit[:10])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hoppers_search_spaces_gain_no_smaller_tiles(family):
    """The smaller tiles are for GPUs with less shared memory: the H200's spaces, which its shipped rows were
    tuned over, stay as they were sized."""
    family = FAMILIES[family]
    for spec in family.presets.values():
        assert family.search_space(spec, H200) == family.search_space(spec, H200_LARGER_SMEM), spec.name
        assert family.search_space(spec, A100).keys() == family.search_space(spec, H200).keys(), spec.name


@pytest.mark.parametrize("device", [H100, H200], ids=lambda d: d.name)
def test_hoppers_defaults_are_the_rules_own(device):
    for family, spec in _specs():
        assert family.fitted_default_rule(spec, device) == family.default_rule(spec, device), spec.name


def test_a_rule_the_device_cannot_hold_loses_only_what_it_must():
    """At d128 the forward's long-sequence tiles (BM128-BN128, 3 stages: ~224 KiB) keep their tiles on an A100
    with one stage fewer; the backward's on a 99 KiB card too, in both kernels."""
    forward_family, backward_family = FAMILIES["attention_fwd"], FAMILIES["attention_bwd"]
    forward = forward_family.presets["llama-prefill"]
    (*_, (_, rule)), (*_, (_, fitted)) = (forward_family.default_rule(forward, A100),
                                          forward_family.fitted_default_rule(forward, A100))
    assert forward_family.feasible(forward, rule, A100) is not None
    assert fitted == dataclasses.replace(rule, num_stages=rule.num_stages - 1)
    assert forward_family.default_config(forward, A100, 1 << 14) == fitted
    backward = backward_family.presets["train-llama"]
    ((_, rule),), ((_, fitted),) = (backward_family.default_rule(backward, RTX_4090),
                                    backward_family.fitted_default_rule(backward, RTX_4090))
    assert backward_family.feasible(backward, rule, RTX_4090) is not None
    assert fitted == dataclasses.replace(rule, num_stages1=2, num_stages2=2)
    assert backward_family.default_config(backward, RTX_4090, 4096) == fitted


def test_the_emitted_module_bakes_the_fitted_defaults():
    from tilegen.families.attention_fwd.standalone import _knobs, entry_point

    family = FAMILIES["attention_fwd"]
    spec = family.presets["llama-prefill"]
    source = entry_point(family, spec, {}, A100, template_hash="0" * 16, triton_version="3.6.0")
    fitted = [(largest, _knobs(config)) for largest, config in family.fitted_default_rule(spec, A100)]
    assert fitted != [(largest, _knobs(config)) for largest, config in family.default_rule(spec, A100)]
    assert f"DEFAULTS = {fitted!r}" in source


def test_a_choice_knob_counts_one_whatever_values_it_changes_between():
    """wgmma picks a kernel, not a size: 3 to 2 or 3 to 1 is one knob changed, as 3 to 0 is, not log2(3/2) or
    log2(3)."""
    from tilegen.families.attention_fwd.config import Config
    from tilegen.families.base import config_distance

    config = Config(128, 128, 8, 2, tma=1, wgmma=3)
    assert {config_distance(config, dataclasses.replace(config, wgmma=w))[0] for w in (0, 1, 2)} == {1.0}
    assert config_distance(config, dataclasses.replace(config, num_stages=3))[0] == pytest.approx(0.5849625)
