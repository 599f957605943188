"""What tilegen reads back from its cache runs as code, so only the user's own files are read.

Generated modules are imported and kernel index records name the kernels launched: the cache
folders are made private (0700), files written 0600, and a folder or file that another user
owns or could write is gone round with one warning (``tilegen.files``). Kernel index records
are JSON of exactly the expected types, and nothing in tilegen unpickles.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch
import triton

import tilegen
from tilegen import dispatch
from tilegen.codegen import cache, module_for, source_for, source_path
from tilegen.families.attention_fwd import AttentionSpec
from tilegen.files import UnsafeError, private_folder, read_private, write_atomically
from tilegen.triton_internals import kernel_index
from tilegen.version import __version__

PACKAGE = Path(tilegen.__file__).resolve().parent


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _owned_by_another_user(path: Path, monkeypatch) -> None:
    if os.geteuid() == 0:
        os.chown(path, 65534, -1)  # nobody
    else:  # only root gives files away: this user seen as another instead
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


def test_cache_folders_are_made_private(tmp_path):
    folder = private_folder(tmp_path / "cache", "a/b")
    assert folder == tmp_path / "cache" / "a" / "b"
    assert [_mode(p) for p in (tmp_path / "cache", tmp_path / "cache" / "a", folder)] == [0o700] * 3
    write_atomically(folder / "f.py", "x = 1\n")
    assert _mode(folder / "f.py") == 0o600
    assert read_private(folder / "f.py") == b"x = 1\n"


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_others_can_write_is_refused(tmp_path, mode):
    (tmp_path / "cache" / "inner").mkdir(parents=True)
    (tmp_path / "cache" / "inner").chmod(mode)
    with pytest.raises(UnsafeError, match=f"writable by other users \\(mode {mode:o}\\)"):
        private_folder(tmp_path / "cache", "inner")
    (tmp_path / "cache").chmod(mode)
    with pytest.raises(UnsafeError, match="cache is writable by other users"):
        private_folder(tmp_path / "cache")


def test_a_file_others_can_write_or_own_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    path.write_text("{}")
    path.chmod(0o666)
    with pytest.raises(UnsafeError, match="writable by other users"):
        read_private(path)
    path.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(UnsafeError, match="symbolic link"):
        read_private(link)
    assert read_private(path) == b"{}"
    _owned_by_another_user(path, monkeypatch)
    with pytest.raises(UnsafeError, match="owned by user id"):
        read_private(path)
    _owned_by_another_user(tmp_path, monkeypatch)
    with pytest.raises(UnsafeError, match="owned by user id"):
        private_folder(tmp_path)


def _spec(head_dim: int) -> AttentionSpec:
    """A spec no other test uses, so module_for has not imported it in this process."""
    return AttentionSpec(head_dim=head_dim, head_dim_v=40, q_per_kv=5, mask="causal", dtype="fp32")


def test_modules_are_not_imported_from_a_cache_folder_others_can_write(tmp_path, monkeypatch):
    """The module is rendered into a private folder of the process instead, and a file planted
    in the shared folder is never run."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(root))
    spec = _spec(40)
    planted = root / f"tilegen-{__version__}_triton-{triton.__version__}" / source_path(spec).name
    marker = tmp_path / "ran"
    planted.write_text(f"open({str(marker)!r}, 'w')\n")
    root.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="not importing generated modules from the cache .*writable by other"):
        module = module_for.__wrapped__(spec)
    assert not marker.exists()
    path = Path(module.__file__)
    assert not path.is_relative_to(root) and path.read_text() == source_for(spec)
    assert path.parent.parent == cache._scratch() and _mode(cache._scratch()) == 0o700
    assert callable(module.launch)


def test_an_op_runs_with_a_cache_folder_others_can_write(tmp_path, monkeypatch, device):
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(root))
    module_for.cache_clear()
    dispatch.launcher_for.cache_clear()
    try:
        x, cos, sin = (torch.randn(3, 2, 48, device=device), torch.randn(3, 48, device=device),
                       torch.randn(3, 48, device=device))
        with pytest.warns(RuntimeWarning, match="not importing generated modules"):
            out = tilegen.apply_rope(x, cos, sin)
        rotated = torch.cat([-x[..., 24:], x[..., :24]], dim=-1)
        torch.testing.assert_close(out, x * cos[:, None] + rotated * sin[:, None], rtol=1e-5, atol=1e-5)
        assert not list(root.iterdir())  # nothing written where others could change it
    finally:
        module_for.cache_clear()
        dispatch.launcher_for.cache_clear()


@pytest.mark.parametrize("spoil", ["writable", "owned"])
def test_a_generated_module_not_the_users_alone_is_replaced_before_the_import(tmp_path, monkeypatch, spoil):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(24 if spoil == "writable" else 56)
    path = source_path(spec)
    path.write_text(source_for(spec))  # the very source: only whose file it is says not to trust it
    if spoil == "writable":
        path.chmod(0o666)
    else:
        _owned_by_another_user(path, monkeypatch)
        if os.geteuid() != 0:
            pytest.skip("only root can give a file away; read_private's check of the owner is tested above")
    inode = path.stat().st_ino
    with pytest.warns(RuntimeWarning, match="replacing a generated module"):
        module = module_for.__wrapped__(spec)
    assert Path(module.__file__) == path
    assert path.stat().st_ino != inode and _mode(path) == 0o600 and path.stat().st_uid == os.geteuid()


def test_a_cache_folder_that_cannot_be_made_renders_into_the_scratch_folder(tmp_path, monkeypatch):
    """A file where TILEGEN_CACHE_DIR names a folder: one warning naming the variable, and the module runs."""
    root = tmp_path / "cache"
    root.write_text("not a folder")
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(root))
    with pytest.warns(RuntimeWarning, match=r"from the cache \(TILEGEN_CACHE_DIR: .*File exists"):
        module = module_for.__wrapped__(_spec(64))
    assert Path(module.__file__).parent.parent == cache._scratch() and callable(module.launch)


def test_a_cache_folder_in_the_home_of_no_such_user_renders_into_the_scratch_folder(monkeypatch):
    """pathlib cannot expand "~name" for a user the system does not know: that is a folder that cannot be made, not
    an error of every op."""
    monkeypatch.setenv("TILEGEN_CACHE_DIR", "~tilegen-no-such-user/cache")
    with pytest.warns(RuntimeWarning, match=r"from the cache \(TILEGEN_CACHE_DIR: ~tilegen-no-such-user/cache: "):
        module = module_for.__wrapped__(_spec(56))
    assert Path(module.__file__).parent.parent == cache._scratch() and callable(module.launch)


def test_a_folder_where_the_module_goes_renders_into_the_scratch_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(72)
    source_path(spec).mkdir()
    with pytest.warns(RuntimeWarning, match="is not a plain file"):
        module = module_for.__wrapped__(spec)
    assert Path(module.__file__).parent.parent == cache._scratch() and callable(module.launch)


@pytest.mark.parametrize("spoil", ["truncated", "garbage"])
def test_a_broken_bytecode_file_of_a_module_is_compiled_again(tmp_path, monkeypatch, spoil):
    """Python reads a module's bytecode file whenever its source's size and second match; a broken one would fail
    every import until removed."""
    import importlib.util
    import py_compile

    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(80 if spoil == "truncated" else 88)
    module_for.__wrapped__(spec)
    path = source_path(spec)
    pyc = Path(importlib.util.cache_from_source(str(path)))
    py_compile.compile(str(path), cfile=str(pyc), doraise=True)
    data = pyc.read_bytes()
    pyc.write_bytes(data[:40] if spoil == "truncated" else data[:16] + b"\xff" * (len(data) - 16))
    assert callable(module_for.__wrapped__(spec).launch)


def test_a_relative_cache_folder_stays_where_it_was_first_read(tmp_path, monkeypatch):
    from tilegen import env

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TILEGEN_CACHE_DIR", "relative-cache")
    first = env.cache_dir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert env.cache_dir() == first == tmp_path / "relative-cache"


def test_a_spec_sent_to_another_process_hashes_there_as_its_equals_do():
    """Python's hash of a spec is salted per process: a pickled spec must not carry the one it had."""
    import pickle
    import subprocess
    import sys

    spec = _spec(96)
    hash(spec)
    assert "_hash" not in pickle.loads(pickle.dumps(spec)).__dict__
    script = ("import pickle, sys; from tilegen.families.attention_fwd import AttentionSpec as S\n"
              "s = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
              "fresh = S(head_dim=96, head_dim_v=40, q_per_kv=5, mask='causal', dtype='fp32')\n"
              "print({fresh: 'found'}.get(s, 'missed'))\n")
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    done = subprocess.run([sys.executable, "-c", script, pickle.dumps(spec).hex()], env=env, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "found"


RECORD = ("a" * 64, "kernel", {"q": "*bf16", "n": "i32", "BLOCK": "constexpr"}, {(2,): 64, (3,): None, (4,): 0.5},
          {(0,): [["tt.divisibility", 16]], (1,): []}, ((True, "num_warps"), (False, 3), (False, None)))


def test_kernel_index_records_are_json_that_comes_back_exactly():
    text = kernel_index.encode(*RECORD)
    assert json.loads(text)["layout"] == kernel_index._LAYOUT
    assert kernel_index.decode(text) == RECORD
    assert kernel_index.decode(text.encode()) == RECORD


@pytest.mark.parametrize("field, value", [
    ("signature", {(0,): "*bf16"}),  # a key that is not a parameter's name
    ("constexprs", {(2,): (1, 2)}),  # a tuple would come back a list
    ("constexprs", {(2,): float("nan")}),  # JSON has no NaN
    ("attrs", {(0,): (("tt.divisibility", 16),)}),
    ("tail", ((True, 3),)),  # a keyword's name that is not a string
    ("tail", ((1, "num_warps"),)),
    ("tail", ((False, [3]),)),
])
def test_values_json_would_not_give_back_make_no_record(field, value):
    names = ["hash", "name", "signature", "constexprs", "attrs", "tail"]
    record = list(RECORD)
    record[names.index(field)] = value
    assert kernel_index.encode(*record) is None


def _record(**changes) -> str:
    record = json.loads(kernel_index.encode(*RECORD))
    for key, value in changes.items():
        if value is ...:
            del record[key]
        else:
            record[key] = value
    return json.dumps(record)


@pytest.mark.parametrize("text", [
    b"\x80\x04\x95\x00garbage",
    "[]",
    "null",
    _record(layout=1),
    _record(layout="2"),
    _record(layout=2.0),
    _record(attrs=...),
    _record(extra=1),
    _record(hash=7),
    _record(hash="../../elsewhere"),
    _record(name="not a name"),
    _record(signature={"q": "*bf16"}),
    _record(signature=[["q", 1]]),
    _record(constexprs=[["2", 64]]),
    _record(constexprs=[[[], 64]]),
    _record(constexprs=[[[True], 64]]),
    _record(constexprs=[[[-1], 64]]),
    _record(constexprs=[[[2], {"a": 1}]]),
    _record(constexprs=[[[2], 64], [[2], 32]]),
    _record(signature=[["q", "*bf16"], ["q", "i32"]]),
    _record(attrs=[[[0], [["tt.divisibility"]]]]),
    _record(attrs=[[[0], [[16, "tt.divisibility"]]]]),
    _record(tail=[[1, "num_warps"]]),
    _record(tail=[[True, None]]),
    _record(tail=[[False, [3]]]),
    _record(tail=[[False, 3, 4]]),
    '{"layout": NaN}',
])
def test_a_record_of_any_other_shape_is_refused(text):
    assert kernel_index.decode(text) is None


def test_the_kernel_index_reads_no_record_from_a_folder_others_can_write(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert kernel_index._folder() == tmp_path / "cache" / "kernels"
    (tmp_path / "cache" / "kernels").chmod(0o777)
    with pytest.warns(RuntimeWarning, match="not using the kernel index: .*kernels is writable by other users"):
        assert kernel_index._folder() is None


def test_nothing_in_tilegen_imports_pickle():
    """A cache holds data, never objects: nothing that could run code on reading it back."""
    unpicklers = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in unpicklers]
    assert not found, found
    assert "torch.load(" not in "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
