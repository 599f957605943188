"""Rules the compiler enforces but Triton's interpreter does not, checked on rendered source.

Exception: a family whose generated module is host code, the blockwise layer's schedule over
query blocks, defines no ``@triton.jit`` function (it calls tilegen's ops, whose kernels are
checked here), so the constexpr rule has nothing to apply to; its module must still render
whole and compile, and must define no kernel that the rule would then miss.
"""

import ast

import pytest
from helpers import kernel_globals_are_constexpr

from tilegen import AttentionSpec, spec_from_json
from tilegen.codegen import source_for

SPECS = [
    pytest.param(AttentionSpec(64), id="d64-none"),
    pytest.param(AttentionSpec(96, head_dim_v=128, q_per_kv=4, mask="window", softcap=True, return_lse=True),
                 id="d96-v128-gqa4-window-softcap-lse"),
    pytest.param(AttentionSpec(128, mask="causal", dtype="fp32"), id="d128-causal-fp32"),
    pytest.param(spec_from_json({"family": "attention_varlen", "head_dim": 96, "q_per_kv": 4, "mask": "window",
                                 "softcap": True, "return_lse": True}), id="varlen-ragged"),
    pytest.param(spec_from_json({"family": "attention_varlen", "head_dim": 64, "mask": "causal",
                                 "kv_layout": "paged", "page_size": 16}), id="varlen-paged16"),
    pytest.param(spec_from_json({"family": "attention_decode", "head_dim": 128, "q_per_kv": 8, "page_size": 1,
                                 "return_lse": True}), id="decode-paged1"),
    pytest.param(spec_from_json({"family": "attention_decode", "head_dim": 40, "kv_layout": "dense", "q_tokens": 4,
                                 "mask": "window", "softcap": True}), id="decode-dense-q4"),
    pytest.param(spec_from_json({"family": "rope", "head_dim": 40, "dtype": "fp16"}), id="rope-d40-padded-half"),
]


HOST_SPECS = [
    pytest.param(spec_from_json({"family": "blockwise_layer", "d_model": 4096, "d_ffn": 14336, "heads_q": 32,
                                 "head_dim": 128, "q_per_kv": 4, "causal": False, "window": True, "softcap": True,
                                 "norm": "layernorm"}), id="layer-schedule-window-softcap-ln"),
]


@pytest.mark.parametrize("spec", SPECS)
def test_globals_read_by_kernels_are_constexpr(spec):
    # The GPU compiler rejects a kernel that reads a plain module-level int
    # ("Cannot access global variable ... from within @jit'ed function").
    kernel_globals_are_constexpr(source_for(spec))


@pytest.mark.parametrize("spec", SPECS + HOST_SPECS)
def test_kernel_source_has_no_jinja_leftovers(spec):
    text = source_for(spec)
    assert "{{" not in text and "{%" not in text
    compile(text, "<generated>", "exec")


@pytest.mark.parametrize("spec", HOST_SPECS)
def test_host_side_modules_define_no_kernel(spec):
    tree = ast.parse(source_for(spec))
    decorated = [fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.decorator_list]
    assert not decorated, f"a host-side module's kernels would escape the constexpr check: {decorated}"
    assert "launch" in {fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef)}
