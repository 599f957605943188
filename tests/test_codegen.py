"""Code generation: lowering, rendering, the on-disk cache of generated modules, ``tilegen emit``."""

from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import triton

import tilegen
from tilegen import AttentionSpec, env
from tilegen.codegen import module_for, render, source_for, source_path
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families.attention_fwd import FAMILY
from tilegen.files import write_atomically

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = FAMILY.template


def all_small_specs():
    """A spread of specs: every mask, softcap, LSE and dtype, with plain, padded and split head dims."""
    dims = [(64, None), (96, None), (40, 128), (256, 16)]
    for (d, dv), mask, softcap, lse, dtype, group in itertools.product(
        dims, ("none", "causal", "window"), (False, True), (False, True), ("fp16", "bf16", "fp32"), (1, 4)
    ):
        yield AttentionSpec(
            head_dim=d, head_dim_v=dv, q_per_kv=group, mask=mask, softcap=softcap, dtype=dtype, return_lse=lse
        )


# --------------------------------------------------------------------------- rendered source

@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(head_dim=64),
        AttentionSpec(head_dim=96, head_dim_v=32, q_per_kv=4, mask="window", softcap=True, dtype="fp32",
                      return_lse=True),
    ],
    ids=lambda s: s.name,
)
def test_source_opens_with_the_spec(spec):
    head = source_for(spec).splitlines()[:6]
    assert f"# {spec.to_json()}" in head
    assert any(spec.hash in line and spec.name in line for line in head)
    assert any(render.template_hash(FAMILY) in line and tilegen.__version__ in line for line in head)


def test_every_spec_renders_valid_python():
    count = 0
    for spec in all_small_specs():
        text = source_for(spec)
        code = compile(text, f"<{spec.name}>", "exec")
        assert code.co_filename == f"<{spec.name}>"
        tree = ast.parse(text)
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert {f"_{spec.name}_kernel", "_attend_blocks", "launch"} <= functions, spec.name
        assert f"SPEC_JSON = {spec.to_json()!r}" in text
        count += 1
    assert count == 4 * 3 * 2 * 2 * 3 * 2


def test_source_is_deterministic_and_differs_per_spec():
    texts = {}
    for spec in all_small_specs():
        text = source_for(spec)
        assert source_for(spec) == text
        texts[spec] = text
    assert len(set(texts.values())) == len(texts)


def test_lowering_decisions_show_in_the_source():
    plain = source_for(AttentionSpec(head_dim=64, dtype="fp16"))
    padded = source_for(AttentionSpec(head_dim=96, head_dim_v=40, dtype="fp16"))
    # Head dims that are not powers of two are padded and masked on load and store.
    assert "m_kd" not in plain and "m_vd" not in plain
    assert "m_kd" in padded and "m_vd" in padded
    assert FAMILY.lower(AttentionSpec(head_dim=96, head_dim_v=40))["head_dim_pad"] == 128
    assert FAMILY.lower(AttentionSpec(head_dim=96, head_dim_v=40))["head_dim_v_pad"] == 64
    # fp32 must not drop to tf32 inside tl.dot.
    assert 'input_precision="ieee"' in source_for(AttentionSpec(head_dim=64, dtype="fp32"))
    assert "input_precision" not in plain
    # Softcap and LSE appear only when asked for.
    assert "inv_softcap" in source_for(AttentionSpec(head_dim=64, softcap=True))
    assert "inv_softcap" not in plain
    assert "tl.store(Lse" in source_for(AttentionSpec(head_dim=64, return_lse=True))
    assert "tl.store(Lse" not in plain
    # The left-edge masked loop exists for windows only; masked specs run heavy tiles first.
    assert source_for(AttentionSpec(head_dim=64, mask="window")).count("_attend_blocks(") == 4
    assert plain.count("_attend_blocks(") == 3
    assert "tl.num_programs(0) - 1 - tl.program_id(0)" in source_for(AttentionSpec(head_dim=64, mask="causal"))
    assert "tl.num_programs(0) - 1 - tl.program_id(0)" not in plain


@pytest.mark.parametrize("layout", ["paged", "ragged"])
def test_non_contiguous_kv_layouts_do_not_lower(layout):
    spec = AttentionSpec(head_dim=64, kv_layout=layout)
    with pytest.raises(NotImplementedError, match=f"kv_layout={layout!r}"):
        FAMILY.lower(spec)
    with pytest.raises(NotImplementedError):
        source_for(spec)
    with pytest.raises(NotImplementedError):
        module_for(spec)


@pytest.mark.parametrize("missing", ["head_dim_pad", "kernel_name", "spec_json", "mask", "softcap"])
def test_missing_context_value_is_an_error(missing):
    spec = AttentionSpec(head_dim=64, mask="window", softcap=True)
    context = render.context_for(FAMILY, spec)
    del context[missing]
    with pytest.raises(jinja2.UndefinedError, match=missing):
        render.render(FAMILY, context)


# ------------------------------------------------------------------------------ template hash

def test_template_hash_covers_the_template_and_every_piece_it_includes():
    closure = render.template_closure(FAMILY)
    assert list(closure)[0] == TEMPLATE
    # The shared pieces every attention template pulls in.
    assert {"common/header.py.jinja", "common/online_softmax.py.jinja", "common/mask_range.py.jinja",
            "common/lse_epilogue.py.jinja"} <= set(closure)
    for name, text in closure.items():
        assert (env.template_dir() / name).read_text() == text
    digest = hashlib.sha256()
    for name, text in sorted(closure.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    assert render.template_hash(FAMILY) == digest.hexdigest()[:16]


@pytest.mark.parametrize("piece", ["common/online_softmax.py.jinja", "common/mask_range.py.jinja",
                                   "common/lse_epilogue.py.jinja", "common/header.py.jinja"])
def test_editing_a_shared_piece_rekeys_the_family(template_copy, piece):
    spec = AttentionSpec(head_dim=64, mask="causal", return_lse=True)
    hash_before, path_before = render.template_hash(FAMILY), source_path(spec)
    with open(template_copy / piece, "a") as f:
        f.write("{# an edit to a shared piece #}\n")
    render._environment.cache_clear()
    render.template_hash.cache_clear()
    assert render.template_hash(FAMILY) != hash_before
    assert source_path(spec) != path_before


@pytest.fixture
def template_copy(tmp_path):
    """A private copy of the templates folder that tilegen reads instead of the real one."""
    copy = tmp_path / "templates"
    shutil.copytree(env.template_dir(), copy)

    def clear():
        render._environment.cache_clear()
        render.template_hash.cache_clear()

    clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(env, "template_dir", lambda: copy)
        yield copy
    clear()  # after the real template_dir is back


def test_editing_the_template_changes_its_hash_and_paths(template_copy):
    spec = AttentionSpec(head_dim=64, mask="causal")
    hash_before = render.template_hash(FAMILY)
    path_before = source_path(spec)
    assert hash_before in path_before.name

    with open(template_copy / TEMPLATE, "a") as f:
        f.write("\n# an edit to the template\n")
    render._environment.cache_clear()
    render.template_hash.cache_clear()

    hash_after = render.template_hash(FAMILY)
    assert hash_after != hash_before
    assert source_path(spec) != path_before and hash_after in source_path(spec).name
    text = source_for(spec)
    assert text.rstrip().endswith("# an edit to the template")
    assert hash_after in text.splitlines()[0]


# ------------------------------------------------------------------------------- cache on disk

def test_source_path_names_spec_and_template():
    spec = AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="fp16")
    path = source_path(spec)
    assert path.suffix == ".py"
    assert spec.name in path.name and spec.hash in path.name
    assert render.template_hash(FAMILY) in path.name
    assert path.parent.parent == env.cache_dir()
    assert tilegen.__version__ in path.parent.name and triton.__version__ in path.parent.name
    # The session's temporary cache, never the user's.
    assert str(env.cache_dir()) == os.environ["TILEGEN_CACHE_DIR"]


def test_module_for_writes_once_and_imports_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    # A spec no other test uses, so module_for's process-wide cache has not seen it.
    spec = AttentionSpec(head_dim=24, head_dim_v=56, q_per_kv=3, mask="window", dtype="fp32", return_lse=True)
    path = source_path(spec)
    assert str(path).startswith(str(tmp_path / "cache"))
    assert not path.exists()

    first = module_for(spec)
    assert path.read_text() == source_for(spec)
    assert Path(first.__file__) == path
    assert first.SPEC_JSON == spec.to_json() and first.SPEC_HASH == spec.hash
    assert callable(first.launch)
    assert module_for(spec) is first
    assert sys.modules[first.__name__] is first
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    # Imported afresh (bypassing the in-process cache), an intact file is reused, not rewritten.
    stat = path.stat()
    module_for.__wrapped__(spec)
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)

    # A truncated or hand-edited file is not trusted: it is rendered again.
    path.write_text(source_for(spec)[:200])
    again = module_for.__wrapped__(spec)
    assert path.read_text() == source_for(spec)
    assert again.SPEC_HASH == spec.hash


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "gen" / "module.py"
    write_atomically(path, "old = 1\n")
    assert path.read_text() == "old = 1\n"

    replaced = []

    def failing_replace(src, dst):
        replaced.append((Path(src), Path(dst)))
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, "new = 2\n" * 1000)
    # The temporary file sat beside the target (so the rename is atomic) and is gone.
    (src, dst), = replaced
    assert src.parent == path.parent and dst == path
    assert not src.exists()
    assert path.read_text() == "old = 1\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["module.py"]


# ----------------------------------------------------------------------------- tilegen emit

def _cli_env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e["TRITON_INTERPRET"] = "1"
    e["COLUMNS"] = "400"  # keep error boxes on one line
    return e


#: Command lines run as `python -m tilegen ...` in subprocesses, all at once.
CLI_RUNS = {
    "flags": ["emit", "--head-dim", "64", "--mask", "causal", "--dtype", "fp16", "--lse"],
    "paged-kv": ["emit", "--spec", '{"family": "attention_fwd", "head_dim": 64, "kv_layout": "paged"}'],
    "bad-head-dim": ["emit", "--head-dim", "65"],
    "unknown-option": ["emit", "--bogus"],
}


@pytest.fixture(scope="module")
def cli_results():
    def run(args):
        return subprocess.run(
            [sys.executable, "-m", "tilegen", *args],
            cwd=REPO_ROOT, env=_cli_env(), capture_output=True, text=True, timeout=300,
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CLI_RUNS)) as pool:
        futures = {name: pool.submit(run, args) for name, args in CLI_RUNS.items()}
        return {name: f.result() for name, f in futures.items()}


def _flat(text: str) -> str:
    """Error text without rich's box drawing and line wrapping."""
    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)


def test_emit_prints_the_source(cli_results):
    result = cli_results["flags"]
    assert result.returncode == 0, result.stderr
    spec = AttentionSpec(head_dim=64, mask="causal", dtype="fp16", return_lse=True)
    assert result.stdout.startswith(source_for(spec))  # then the interpreter's mend (test_db_cli.py runs it)


def test_emit_refuses_kv_layouts_it_cannot_lower(cli_results):
    result = cli_results["paged-kv"]
    assert result.returncode == 2
    assert result.stdout == ""
    assert "kv_layout='paged'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "name,needle",
    [("bad-head-dim", "head_dim"), ("unknown-option", "--bogus")],
)
def test_emit_bad_flags_exit_with_a_message(cli_results, name, needle):
    result = cli_results[name]
    assert result.returncode != 0
    assert result.stdout == ""
    assert needle in _flat(result.stderr)
    assert "Traceback" not in result.stderr + result.stdout


# In-process runs of the same app for the cases that need no fresh interpreter.

@pytest.fixture
def invoke():
    from typer.testing import CliRunner

    from tilegen.cli import app

    def run(*args):
        return CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})

    return run


def test_emit_spec_file_to_output_file(invoke, tmp_path):
    spec = AttentionSpec(head_dim=128, q_per_kv=4, mask="window", softcap=True)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.to_json())
    out = tmp_path / "kernel.py"
    result = invoke("emit", "--spec", str(spec_file), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith(source_for(spec))
    assert spec.hash in result.stderr


def test_emit_preset(invoke):
    from tilegen.cli.spec_args import presets

    result = invoke("emit", "--preset", "llama-prefill")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(source_for(presets()["llama-prefill"]))


@pytest.mark.parametrize(
    "args,needle",
    [
        pytest.param(["--head-dim", "64", "--dtype", "fp64"], "dtype", id="bad-dtype"),
        pytest.param(["--head-dim", "64", "--mask", "sliding"], "mask", id="bad-mask"),
        pytest.param(["--head-dim", "64", "--q-per-kv", "0"], "q_per_kv", id="bad-q-per-kv"),
        pytest.param(["--spec", '{"family": "attention_fwd", "head_dim": 64, "block_m": 64}'], "block_m", id="unknown-field"),
        pytest.param(["--spec", '{"head_dim": 64}'], "family: missing", id="no-family"),
        pytest.param(["--spec", '{"head_dim": 64, "family": "x"}'], "family", id="unknown-family"),
        pytest.param(["--spec", '{"head_dim": 64'], "--spec", id="malformed-json"),
        pytest.param(["--spec", "/nonexistent/spec.json"], "--spec", id="missing-spec-file"),
        pytest.param(["--preset", "nope"], "nope", id="unknown-preset"),
        pytest.param(["--preset", "default", "--head-dim", "64"], "--preset", id="two-sources"),
        pytest.param(["--head-dim", "sixty-four"], "--head-dim", id="not-an-int"),
    ],
)
def test_emit_bad_flags_in_process(invoke, args, needle):
    result = invoke("emit", *args)
    assert result.exit_code not in (0, None)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # a clean exit, no traceback
    assert result.stdout == ""
    assert needle in _flat(result.stderr)


H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
DEFAULT_RULE_SPECS = [
    AttentionSpec(head_dim=d, head_dim_v=dv, dtype=dtype)
    for d, dv in ((16, None), (64, None), (96, None), (128, None), (256, None), (40, 128), (256, 16))
    for dtype in ("bf16", "fp16", "fp32")
]


@pytest.mark.parametrize("device", [H200, CPU_INTERPRETER], ids=["h200", "interpreter"])
@pytest.mark.parametrize("spec", DEFAULT_RULE_SPECS, ids=lambda s: s.name)
def test_default_rule_covers_every_bucket_with_a_feasible_config(spec, device):
    rule = FAMILY.default_rule(spec, device)
    bounds = [largest for largest, _ in rule]
    assert bounds[-1] is None and None not in bounds[:-1] and bounds[:-1] == sorted(bounds[:-1])
    space = FAMILY.candidates(spec, device)
    for largest, config in rule:
        assert config in space, (largest, config)
    for bucket in (16, 1024, 2048, 4096, 1 << 20):
        expected = next(c for b, c in rule if b is None or bucket <= b)
        assert FAMILY.default_config(spec, device, bucket) == expected
