"""Test setup shared by every tilegen test.

Without a GPU the kernels run under Triton's CPU interpreter, which must be chosen
before any Triton kernel is defined, so it is set here, first, before tilegen or
triton is imported. Generated sources and tuning databases go to a temporary
folder for the session: tests never touch the user's cache or database.
"""

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# One folder for the whole session (pytest's tmp_path_factory only exists once a
# session runs; these must be set before the first test imports tilegen's modules).
_SESSION_DIR = tempfile.mkdtemp(prefix="tilegen-tests-")
os.environ["TILEGEN_CACHE_DIR"] = os.path.join(_SESSION_DIR, "cache")
os.environ["TILEGEN_DB"] = os.path.join(_SESSION_DIR, "tuning.sqlite")
# The CLI's tables are checked cell by cell. Rich fits them to the console, 80 columns without a terminal, and
# elides the cells a long path crowds out (a pytest-xdist worker's temporary folders are longer).
os.environ.setdefault("COLUMNS", "250")

import pytest  # noqa: E402

from tilegen import dispatch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    # Noise from Triton's CPU interpreter (numpy deprecations, log2(0) for rows that see
    # no key, which is the intended -inf), thousands of times per run.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:divide by zero encountered in log2:RuntimeWarning")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_dispatch_tables():
    """Each test reads the (empty, temporary) tuning databases afresh."""
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture(scope="session")
def session_dir() -> str:
    return _SESSION_DIR


@pytest.fixture
def device() -> str:
    """Where test tensors live: the GPU when there is one, else the CPU (under the interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
