"""Every test run builds into its own kernel cache, never the user's.

`pytest_configure` points ``CHAINFUSE_CACHE_DIR`` (`chainfuse.config.ENV_CACHE_DIR`) at a fresh
temporary directory before collection (collecting already probes the compiler, which writes to
the cache) and `pytest_unconfigure` restores the variable and deletes the directory. Subprocesses
inherit it. ``CHAINFUSE_TEST_CACHE_DIR=path`` reuses `path` instead (kept between runs, so a
second run skips compiling); the autouse `kernel_cache` fixture checks no test leaves it changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chainfuse.config import ENV_CACHE_DIR, cache_dir

ENV_TEST_CACHE_DIR = "CHAINFUSE_TEST_CACHE_DIR"
_ENV = ENV_CACHE_DIR

_isolated: dict[str, object] = {}  # the directory, the variable's previous value, whether ours


def pytest_configure(config: pytest.Config) -> None:
    persistent = os.environ.get(ENV_TEST_CACHE_DIR, "").strip()
    if persistent:
        path = Path(persistent).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="chainfuse-test-cache-")).resolve()
    _isolated.update(path=path, previous=os.environ.get(_ENV), temporary=not persistent)
    os.environ[_ENV] = str(path)
    assert cache_dir() == path, f"{_ENV} points at {cache_dir()}, not {path}"


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _isolated:
        return
    previous = _isolated["previous"]
    if previous is None:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = str(previous)
    if _isolated["temporary"]:
        shutil.rmtree(str(_isolated["path"]), ignore_errors=True)
    _isolated.clear()


@pytest.fixture(autouse=True)
def kernel_cache() -> Iterator[Path]:
    """The run's kernel cache (tests that need their own point the variable elsewhere through a
    fixture); fails a test that leaves ``CHAINFUSE_CACHE_DIR`` other than it found it."""
    path = _isolated["path"]
    assert isinstance(path, Path)
    before = os.environ.get(_ENV)
    yield path
    assert os.environ.get(_ENV) == before, f"a test left {_ENV} changed"
