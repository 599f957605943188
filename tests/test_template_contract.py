"""Rules the compiler enforces but Triton's interpreter does not, checked on rendered source."""

import ast

import pytest

from tilegen.codegen import source_for
from tilegen import AttentionSpec

SPECS = [
    pytest.param(AttentionSpec(64), id="d64-none"),
    pytest.param(AttentionSpec(96, head_dim_v=128, q_per_kv=4, mask="window", softcap=True, return_lse=True),
                 id="d96-v128-gqa4-window-softcap-lse"),
    pytest.param(AttentionSpec(128, mask="causal", dtype="fp32"), id="d128-causal-fp32"),
]


def _kernel_functions(tree):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
        ):
            yield node


@pytest.mark.parametrize("spec", SPECS)
def test_globals_read_by_kernels_are_constexpr(spec):
    # The GPU compiler rejects a kernel that reads a plain module-level int
    # ("Cannot access global variable ... from within @jit'ed function").
    tree = ast.parse(source_for(spec))
    plain = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and not ast.unparse(node.value).startswith("tl.constexpr(")
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    kernels = list(_kernel_functions(tree))
    assert kernels, "no @triton.jit function in the generated module"
    for fn in kernels:
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        assert not (used & plain), f"{fn.name} reads non-constexpr globals {sorted(used & plain)}"


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_source_has_no_jinja_leftovers(spec):
    text = source_for(spec)
    assert "{{" not in text and "{%" not in text
    compile(text, "<generated>", "exec")
