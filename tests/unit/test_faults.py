"""Faults a user (or a damaged disk) can cause in the runtime, each answered: a damaged cache is
rebuilt, a bad compiler or environment gets an error or a warning naming it, never a crash or a
hang of the Python process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import chainfuse
from chainfuse import config
from chainfuse.compiler import compile
from chainfuse.planner import Plan
from chainfuse.runtime import (
    CompileError,
    CompilerNotFoundError,
    build,
    find_compiler,
    get_num_threads,
    load,
)
from tests.checks import check_against_reference

REPO = Path(chainfuse.__file__).resolve().parents[1]
ADD_ONE = "int add_one(int x) { return x + 1; }\n"
CHAIN = chainfuse.gemm_chain(2, 17, 7, 65, 63, "relu")


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache for this module's tests (a kernel compiled once), never the run's: they
    damage what is in it."""
    cache = tmp_path_factory.mktemp("faults-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(config.ENV_CACHE_DIR, str(cache))
        yield cache


@pytest.fixture
def plan_file(module_cache: Path) -> tuple[Path, Plan]:
    """The plan file `compile(CHAIN)` remembers, and the plan it should hold."""
    compile(CHAIN)
    (path,) = [
        p for p in module_cache.glob("plans/*/*.json") if Plan.from_json(p.read_text()).chain
        == CHAIN.name
    ]  # fmt: skip
    return path, Plan.from_json(path.read_text())


def _with_tiles(text: str, value: Any) -> str:
    data = json.loads(text)
    for tiles in data["tiles"].values():
        for loop in tiles:
            tiles[loop] = value
    return json.dumps(data)


DAMAGES = {
    "zero tiles": lambda t: _with_tiles(t, 0),
    "negative tiles": lambda t: _with_tiles(t, -5),
    "huge tiles": lambda t: _with_tiles(t, 10**6),
    "string tiles": lambda t: _with_tiles(t, "many"),
    "list tiles": lambda t: _with_tiles(t, [4]),
    "infinite tiles": lambda t: _with_tiles(t, 1e400),
    "null": lambda t: "null",
    "a list": lambda t: "[1, 2]",
    "garbage": lambda t: "{not json",
    "truncated": lambda t: t[: len(t) // 2],
    "binary": lambda t: "\udcff\x00\x01",
    "another chain's": lambda t: t.replace(CHAIN.name, "attention"),
    "other loops": lambda t: t.replace('"m"', '"q"'),
    "no threads": lambda t: json.dumps({**json.loads(t), "threads": 0}),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_remembered_plan_is_replanned_and_rewritten(
    plan_file: tuple[Path, Plan], damage: str
) -> None:
    path, good = plan_file
    path.write_bytes(DAMAGES[damage](path.read_text()).encode("utf-8", "surrogateescape"))
    with pytest.warns(RuntimeWarning, match="ignoring the remembered plan"):
        kernel = compile(CHAIN)
    assert kernel.plan == good
    check_against_reference(kernel, CHAIN)
    assert Plan.from_json(path.read_text()) == good  # rewritten whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sound plan is taken without a word
        assert compile(CHAIN).plan == good


def test_a_plan_for_a_larger_chain_is_not_trusted(plan_file: tuple[Path, Plan]) -> None:
    path, good = plan_file
    big = chainfuse.gemm_chain(2, 170, 70, 650, 630, "relu")
    compile(big)
    (other,) = [p for p in path.parent.parent.glob("*/*.json") if p != path and
                Plan.from_json(p.read_text()).tiles != good.tiles]  # fmt: skip
    path.write_text(other.read_text())
    with pytest.warns(RuntimeWarning, match="it is for 'gemm_relu_gemm_float32_b2m170"):
        compile(CHAIN)
    # the same, its name made to match: its tiles are out of range here
    path.write_text(other.read_text().replace(big.name, CHAIN.name))
    with pytest.warns(RuntimeWarning, match="not within 1.."):
        kernel = compile(CHAIN)
    assert kernel.plan == good
    check_against_reference(kernel, CHAIN)


@pytest.mark.parametrize("content", ["null", "[1, 2]", "{garbage", "7", "damaged facts"])
def test_a_damaged_toolchain_file_is_ignored_and_rewritten(tmp_path: Path, content: str) -> None:
    cache = tmp_path / "cache"
    facts = cache / "toolchain.json"
    cache.mkdir()
    facts.write_text(content)
    code = f"from chainfuse.runtime import build, load; print(load(build({ADD_ONE!r}, 'k').path).add_one(1))"

    def run() -> None:
        child = subprocess.run(
            [sys.executable, "-c", code],
            env=_child_env(**{config.ENV_CACHE_DIR: str(cache)}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == ["2"]

    run()
    good = json.loads(facts.read_text())
    assert isinstance(good, dict) and good
    if content == "damaged facts":  # every fact of the right key and the wrong form
        facts.write_text(json.dumps({key: 5 for key in good}))
    run()
    assert json.loads(facts.read_text()) == good


def test_a_foreign_shared_object_in_the_cache_is_rebuilt(module_cache: Path) -> None:
    mine = build(ADD_ONE + "/* mine */\n", "add_one")
    other = build("int other(int x) { return x; }\n", "other")
    mine.path.unlink()  # (a new file: never loaded, safe to replace)
    mine.path.write_bytes(other.path.read_bytes())
    again = build(ADD_ONE + "/* mine */\n", "add_one")
    assert not again.cached and again.path == mine.path
    assert load(again.path).add_one(1) == 2


def test_cc_with_arguments_is_split_like_a_shell_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "gcc -O2 -DCHAINFUSE_TEST_ARG=1")
    cc = find_compiler()
    assert cc.path.endswith("gcc") and cc.args == ("-O2", "-DCHAINFUSE_TEST_ARG=1")
    source = "int arg(void) { return CHAINFUSE_TEST_ARG + 1; }\n"
    assert load(build(source, "arg").path).arg() == 2
    monkeypatch.setenv("CC", "gcc 'unbalanced")
    with pytest.raises(CompilerNotFoundError, match='CC="gcc \'unbalanced"'):
        find_compiler()


@pytest.mark.parametrize("cc", ["/bin/true", "echo", "/bin/false"])
def test_cc_that_is_not_a_c_compiler_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cc: str
) -> None:
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", cc)
    with pytest.raises(CompilerNotFoundError) as info:
        build(ADD_ONE, "add_one")
    message = str(info.value)
    assert message.startswith(f"CC={cc!r}: ") and "not a GCC-compatible C compiler" in message


HANGING_CC = """#!/bin/sh
# a compiler that answers the probes (as gcc) and hangs on a kernel's build
case "$*" in
  *-dM*|*probe.c*) exec gcc "$@" ;;
esac
exec sleep 30
"""


def test_a_hanging_compiler_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "hanging-cc"
    fake.write_text(HANGING_CC)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("CHAINFUSE_CC_TIMEOUT", "2")
    start = time.monotonic()
    with pytest.raises(CompileError, match=r"did not finish within 2 s.*CHAINFUSE_CC_TIMEOUT"):
        build(ADD_ONE + "/* hangs */\n", "add_one")
    assert time.monotonic() - start < 20
    monkeypatch.setenv("CHAINFUSE_CC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CHAINFUSE_CC_TIMEOUT='soon'"):
        config.cc_timeout()


def test_cached_kernels_load_without_a_compiler(tmp_path: Path) -> None:
    """A process with no compiler on PATH loads what the cache holds (the compiler's identity,
    part of the key, is remembered from the last build); only a new kernel needs one."""
    env = _child_env(**{config.ENV_CACHE_DIR: str(tmp_path / "cache")})
    env.pop("CC", None)
    code = textwrap.dedent("""
        import sys
        import chainfuse
        from chainfuse.runtime import CompilerNotFoundError
        from tests.checks import check_against_reference
        chain = chainfuse.gemm_chain(2, 17, 7, 65, 63, "relu")
        kernel = chainfuse.compile(chain)
        check_against_reference(kernel, chain)
        print(kernel.cached)
        if sys.argv[1] == "new":
            try:
                chainfuse.compile(chainfuse.gemm_chain(2, 17, 7, 65, 63, "gelu"))
            except CompilerNotFoundError as err:
                print("no compiler:", err)
    """)
    for path, want in ((env["PATH"], "False"), ("", "True")):
        child = subprocess.run(
            [sys.executable, "-c", code, "new" if not path else "-"],
            env={**env, "PATH": path},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert child.returncode == 0, child.stderr
        lines = child.stdout.splitlines()
        assert lines[0] == want
    assert lines[1].startswith("no compiler: no C compiler (cc, gcc or clang) found on PATH")


@pytest.mark.parametrize("value", ["abc", "0", "-1", ","])
def test_a_bad_omp_num_threads_is_ignored_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    config._threads_from.cache_clear()  # (a value warns once per process)
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = get_num_threads()
        kernel = compile(CHAIN)
        check_against_reference(kernel, CHAIN)
        get_num_threads()
    assert n == len(os.sched_getaffinity(0))
    messages = [str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w.message)]
    assert len(messages) == 1 and repr(value) in messages[0], messages


def test_fallback_cache_directories_are_removed(tmp_path: Path) -> None:
    """A process whose cache cannot be written builds into a temporary directory, removed when
    it exits; one left by a process that was killed is removed by the next that falls back."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    stale = tmp / f"chainfuse-fallback-{dead}-x1"
    (stale / "ab").mkdir(parents=True)
    alive = tmp / f"chainfuse-fallback-{os.getpid()}-x2"
    alive.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # (a directory under a file: unwritable even by root)
    code = (
        "import warnings; from chainfuse.runtime import build, load\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    r = build({ADD_ONE!r}, 'add_one')\n"
        "print(load(r.path).add_one(1), r.path.parent.parent, len(w))"
    )
    env = _child_env(TMPDIR=str(tmp), **{config.ENV_CACHE_DIR: str(blocker / "sub")})
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr
    answer, root, warned = child.stdout.split()
    assert answer == "2" and warned == "1"
    assert Path(root).parent == tmp and not Path(root).exists()
    assert not stale.exists() and alive.exists()
