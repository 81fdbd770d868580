"""chainfuse.runtime: compiler discovery, the content-addressed cache, loading, threads."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import chainfuse
from chainfuse import config
from chainfuse.runtime import (
    BASE_FLAGS,
    CompileError,
    CompilerFamily,
    CompilerNotFoundError,
    build,
    build_recipe,
    files_fingerprint,
    find_compiler,
    flags,
    get_num_threads,
    load,
    set_num_threads,
)
from chainfuse.runtime import cache as cache_module
from tests.checks import check_against_reference

REPO = Path(chainfuse.__file__).resolve().parents[1]

ADD_ONE = "int add_one(int x) { return x + 1; }\n"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test builds into its own cache, so results never leak between tests."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(cache))
    monkeypatch.delenv(config.ENV_DUMP, raising=False)
    return cache


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*.so"))


def _child_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[config.ENV_CACHE_DIR] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_find_compiler_identifies_gcc_or_clang() -> None:
    cc = find_compiler()
    assert os.path.isabs(cc.path)
    assert cc.family in (CompilerFamily.GCC, CompilerFamily.CLANG)
    assert cc.version.count(".") == 2 and cc.version.split(".")[0].isdigit()


def test_flags_are_the_documented_ones_and_never_fast_math() -> None:
    got = flags(find_compiler(), ("-mfma",))
    assert got[: len(BASE_FLAGS)] == BASE_FLAGS
    assert got[-1] == "-mfma"
    assert "-ffast-math" not in got and "-ffp-contract=fast" in got


def test_build_load_and_call(_private_cache: Path) -> None:
    result = build(ADD_ONE, "add_one")
    assert not result.cached
    assert result.path.parent.parent == _private_cache
    assert result.path.parent.name == result.key[:2]
    assert result.path.name == f"add_one_{result.key[:16]}.so"
    assert result.source_path.read_text() == ADD_ONE
    lib = load(result.path)
    assert lib.add_one(41) == 42
    assert load(result.path) is lib


def test_second_build_is_a_cache_hit_in_this_and_a_new_process(_private_cache: Path) -> None:
    first = build(ADD_ONE, "add_one")
    again = build(ADD_ONE, "add_one")
    assert again.cached and again.path == first.path and again.key == first.key
    assert again.seconds < first.seconds
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from chainfuse.runtime import build, load\n"
                f"r = build({ADD_ONE!r}, 'add_one')\n"
                "print(r.cached, load(r.path).add_one(1), r.path)"
            ),
        ],
        env=_child_env(_private_cache),
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == ["True", "2", str(first.path)]


def test_different_source_or_flags_is_a_different_entry(_private_cache: Path) -> None:
    a = build(ADD_ONE, "k")
    b = build(ADD_ONE.replace("+ 1", "+ 2"), "k")
    c = build(ADD_ONE, "k", ("-DUNUSED=1",))
    assert len({a.key, b.key, c.key}) == 3
    assert len(_entries(_private_cache)) == 3


def test_truncated_entry_is_rebuilt(_private_cache: Path) -> None:
    first = build(ADD_ONE, "add_one")
    size = first.path.stat().st_size
    with open(first.path, "r+b") as f:  # never loaded in this process: safe to truncate
        f.truncate(size // 2)
    again = build(ADD_ONE, "add_one")
    assert not again.cached and again.path == first.path
    assert again.path.stat().st_size == size
    first.path.write_bytes(b"")
    third = build(ADD_ONE, "add_one")
    assert not third.cached and third.path.stat().st_size == size
    # corrupt at full size (its digest no longer matches): rebuilt too
    third.path.write_bytes(bytes(reversed(third.path.read_bytes())))
    fourth = build(ADD_ONE, "add_one")
    assert not fourth.cached and fourth.path.stat().st_size == size
    assert load(fourth.path).add_one(1) == 2


WITH_HEADERS = "#include <math.h>\n#include <string.h>\n" + ADD_ONE


def _headers(cache: Path) -> list[Path]:
    return sorted(cache.glob("pch/*/cf_system.h.gch"))


@pytest.mark.skipif(find_compiler().family is not CompilerFamily.GCC, reason="gcc only")
def test_system_headers_are_precompiled_once_and_reused(
    _private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first build of a source with #include lines notes that the header is wanted, the
    second makes it next to its compile, the next passes it with -include; a damaged header
    (garbage of another size on disk) is made again."""
    first = build(WITH_HEADERS, "add_one")
    assert load(first.path).add_one(1) == 2
    assert _headers(_private_cache) == []
    build(WITH_HEADERS.replace("+ 1", "+ 5"), "add_five")
    (gch,) = _headers(_private_cache)
    assert gch.stat().st_size > 0
    commands: list[tuple[str, ...]] = []
    real_run = cache_module.run_compiler

    def spy(command: tuple[str, ...]) -> object:
        commands.append(tuple(command))
        return real_run(command)

    monkeypatch.setattr(cache_module, "run_compiler", spy)
    second = build(WITH_HEADERS.replace("+ 1", "+ 2"), "add_two")
    assert not second.cached and load(second.path).add_one(1) == 3
    assert len(commands) == 1 and "-include" in commands[0]
    assert str(gch.with_suffix("")) in commands[0]
    gch.write_bytes(b"not a precompiled header")
    commands.clear()
    third = build(WITH_HEADERS.replace("+ 1", "+ 3"), "add_three")
    assert load(third.path).add_one(1) == 4
    assert "-include" not in commands[0]
    assert gch.stat().st_size > 1000
    commands.clear()
    build(WITH_HEADERS.replace("+ 1", "+ 4"), "add_four")
    assert "-include" in commands[0]


def test_sources_without_includes_or_with_feature_macros_make_no_precompiled_header(
    _private_cache: Path,
) -> None:
    for plus in range(1, 3):
        build(ADD_ONE.replace("+ 1", f"+ {plus}"), "add_one")
        build(f"#define _POSIX_C_SOURCE 199309L\n#include <time.h>\n/* {plus} */" + ADD_ONE, "k")
    assert _headers(_private_cache) == []


def test_unwritable_cache_dir_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests may run as root, whom chmod does not stop: a directory under a regular file can
    # never be created, whoever we are.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    unwritable = blocker / "sub"
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(unwritable))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = build(ADD_ONE, "add_one")
        b = build(ADD_ONE.replace("+ 1", "+ 3"), "add_three")
        c = build(ADD_ONE, "add_one")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert str(unwritable) in messages[0]
    assert a.path.parent.parent == b.path.parent.parent
    assert a.path.parent.parent.name.startswith("chainfuse-")
    assert c.cached and c.path == a.path
    assert load(b.path).add_one(1) == 4
    shutil.rmtree(a.path.parent.parent, ignore_errors=True)  # the process's fallback directory


def test_missing_compiler_says_how_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(CompilerNotFoundError, match="apt-get install gcc") as info:
        find_compiler()
    assert "CC" in str(info.value)
    monkeypatch.delenv("CC")
    with pytest.raises(CompilerNotFoundError, match="install gcc or clang"):
        build(ADD_ONE, "add_one")


def test_cc_that_is_not_a_c_compiler_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "true")
    with pytest.raises(CompilerNotFoundError, match="not a GCC-compatible"):
        find_compiler()


def test_compile_error_carries_stderr_and_saved_source() -> None:
    bad = "int broken(int x) { return x + ; }\n"
    with pytest.raises(CompileError) as info:
        build(bad, "broken")
    err = info.value
    assert "error" in err.stderr and err.stderr.strip() in str(err)
    assert err.source_path.read_text() == bad
    assert str(err.source_path) in str(err)
    assert not list(err.source_path.parent.glob("*.so")) and not list(
        err.source_path.parent.glob(".*.tmp")
    )


def test_concurrent_builds_from_eight_processes_share_one_entry(_private_cache: Path) -> None:
    source = ADD_ONE + "/* concurrent */\n"
    script = textwrap.dedent(f"""
        from chainfuse.runtime import build, load
        r = build({source!r}, "add_one")
        print(r.cached, load(r.path).add_one(1), r.path)
    """)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=_child_env(_private_cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err
        outputs.append(out.split())
    # exactly one compiled; the seven others waited on the lock and found its entry
    assert sorted(o[0] for o in outputs) == ["False"] + ["True"] * 7
    assert {o[1] for o in outputs} == {"2"}
    assert len({o[2] for o in outputs}) == 1
    assert len(_entries(_private_cache)) == 1


def test_dump_dir_receives_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump = tmp_path / "dump"
    monkeypatch.setenv(config.ENV_DUMP, str(dump))
    result = build(ADD_ONE, "add_one")
    assert (dump / f"add_one_{result.key[:16]}.c").read_text() == ADD_ONE


def test_a_recipe_found_in_the_cache_is_not_generated_again(
    _private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []

    def make() -> str:
        made.append(1)
        return ADD_ONE

    first = build_recipe("add one, v1", "add_one_r", make)
    assert not first.cached and len(made) == 1
    again = build_recipe("add one, v1", "add_one_r", make)
    assert again.cached and again.path == first.path and len(made) == 1, "no source generated"
    assert load(again.path).add_one(41) == 42
    # another recipe is another index entry (here: the same source, so the same object)
    other = build_recipe("add one, v2", "add_one_r", make)
    assert other.path == first.path and len(made) == 2
    # an index whose object is gone, truncated or named by garbage: generated and built again
    data = first.path.read_bytes()
    first.path.unlink()  # (a new file: the loaded copy stays mapped from the old one)
    first.path.write_bytes(data[:100])
    rebuilt = build_recipe("add one, v1", "add_one_r", make)
    assert not rebuilt.cached and len(made) == 3 and len(rebuilt.path.read_bytes()) > 100
    for index in (_private_cache / "recipes").glob("*/*.key"):
        index.write_text("not a key\n")
    assert build_recipe("add one, v1", "add_one_r", make).cached and len(made) == 4
    # CHAINFUSE_DUMP wants every source: it is generated even when the object is cached
    monkeypatch.setenv(config.ENV_DUMP, str(tmp_path / "dump"))
    assert build_recipe("add one, v1", "add_one_r", make).cached and len(made) == 5
    assert list((tmp_path / "dump").glob("add_one_r_*.c"))


def test_a_warm_kernel_loads_without_generating_its_source(_private_cache: Path) -> None:
    chain = chainfuse.gemm_chain(2, 17, 7, 65, 63, "relu")
    cold = chainfuse.compile(chain)
    code = """
import chainfuse, chainfuse.compiled as c
c.emit_gemm_chain = None  # a call would fail
k = chainfuse.compile(chainfuse.gemm_chain(2, 17, 7, 65, 63, "relu"))
print(k.cached, k.path)
"""
    child = subprocess.run([sys.executable, "-c", code], env=_child_env(_private_cache),
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert child.stdout.split() == ["True", str(cold.path)]
    # the cold build kept the source it built from; a warm kernel generates it on demand, and
    # both are the bytes the cache saved next to the object
    saved = cold.path.with_suffix(".c").read_text()
    assert "relu" in cold.source and cold.source is cold.source and cold.source == saved
    read = """
import chainfuse
k = chainfuse.compile(chainfuse.gemm_chain(2, 17, 7, 65, 63, "relu"))
print(k.cached)
print(k.source, end="")
"""
    warm = subprocess.run([sys.executable, "-c", read], env=_child_env(_private_cache),
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert warm.stdout == "True\n" + saved


def test_files_fingerprint_moves_with_a_file_and_only_then(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    first = files_fingerprint([a, b])
    assert files_fingerprint([a, b]) == first
    a.write_text("x = 10\n")  # another size
    second = files_fingerprint([a, b])
    assert second != first
    stat = a.stat()
    a.write_text("x = 11\n")  # the same size, a later time
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert files_fingerprint([a, b]) != second
    b.unlink()
    assert files_fingerprint([a, b]) not in (first, second)


def test_bad_kernel_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="C identifier"):
        build(ADD_ONE, "../escape")


def test_threads_default_override_and_kernel_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")
    assert get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert get_num_threads() == len(os.sched_getaffinity(0))
    set_num_threads(2)
    try:
        assert get_num_threads() == 2
    finally:
        set_num_threads(None)
    with pytest.raises(ValueError):
        set_num_threads(0)

    # The pattern every generated kernel follows: the thread count is an argument.
    source = textwrap.dedent("""
        long tid_sum(int n, int nt) {
            long s = 0;
        #pragma omp parallel for reduction(+ : s) num_threads(nt)
            for (int i = 0; i < n; ++i) s += i;
            return s;
        }
    """)
    lib = load(build(source, "tid_sum").path)
    lib.tid_sum.restype = ctypes.c_long
    assert lib.tid_sum(1000, get_num_threads()) == 999 * 1000 // 2
    assert os.environ.get(config.ENV_WAIT_POLICY)  # PASSIVE unless the user chose otherwise


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_threaded_kernels_runs_them_on_one_thread() -> None:
    # GNU OpenMP's workers do not survive a fork: the child's next parallel region waited for
    # them forever. The child runs its kernels on one thread instead, warns once, and gets the
    # result the parent got; the parent keeps its threads
    import select
    import signal

    from chainfuse import reference
    from chainfuse.compiler import compile

    chain = chainfuse.attention_chain(2, 4, 256, 256, 64, 64)  # (long enough for 2 threads)
    inputs = reference.random_inputs(chain, seed=1)
    args = [inputs[t.name] for t in chain.inputs]
    set_num_threads(2)
    try:
        kernel = compile(chain, threads=2)
        assert not kernel._alone  # (its calls start the OpenMP workers)
        want = kernel(*args)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reports through the pipe, never returns into pytest
            verdict = b"error"
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = [kernel(*args), chainfuse.ops.attention(*args)]
                forked = [x for x in caught if "was forked while" in str(x.message)]
                reference.assert_close(got[0], want, chain)
                reference.assert_close(got[1], want, chain)
                ok = len(forked) == 1 and get_num_threads() == 1
                verdict = b"ok" if ok else f"warnings {len(forked)}".encode()
            finally:
                os.write(w, verdict)
                os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 120)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's kernel call hung")
        verdict = os.read(r, 64)
        os.close(r)
        os.waitpid(pid, 0)
        assert verdict == b"ok"
        assert get_num_threads() == 2
    finally:
        set_num_threads(None)


def test_kernels_differing_only_in_their_header_compile_once(_private_cache: Path) -> None:
    """Head dims 16 and 32 give the same code (the softmax scale is an argument; only the header
    comment says it): one compiled object, the second a cache hit, each header its own."""
    from chainfuse.compiler import compile

    chains = [chainfuse.attention_chain(1, 2, 33, 40, d, d) for d in (16, 32)]
    first, second = (compile(chain) for chain in chains)
    assert first.spec.name == second.spec.name  # (the same structure: the premise)
    assert not first.cached and second.cached
    assert second.path == first.path and len(_entries(_private_cache)) == 1
    assert "scale=0.25" in first.source and "scale=0.176777" in second.source
    for chain, kernel in zip(chains, (first, second), strict=True):
        check_against_reference(kernel, chain, seed=3)


def test_set_num_threads_changed_while_other_threads_call() -> None:
    """Three threads call one kernel while a fourth flips the thread count: every result
    matches the reference, and nothing deadlocks (each caller keeps a workspace per count)."""
    import threading

    from chainfuse import reference
    from chainfuse.compiler import compile

    chain = chainfuse.attention_chain(2, 4, 256, 256, 64, 64)  # (long enough for 2 threads)
    kernel = compile(chain, threads=2)
    inputs = reference.random_inputs(chain, seed=2)
    args = [inputs[t.name] for t in chain.inputs]
    want = reference.run(chain, inputs)[chain.outputs[0].name]
    stop = threading.Event()
    failures: list[BaseException] = []

    def call() -> None:
        try:
            for _ in range(15):
                reference.assert_close(kernel(*args), want, chain)
        except BaseException as err:  # (reported by the main thread)
            failures.append(err)

    def flip() -> None:
        counts = [1, 2, None, 3]
        i = 0
        while not stop.is_set():
            set_num_threads(counts[i % len(counts)])
            i += 1

    flipper = threading.Thread(target=flip, daemon=True)
    callers = [threading.Thread(target=call, daemon=True) for _ in range(3)]
    flipper.start()
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in callers), "a caller deadlocked"
    finally:
        stop.set()
        flipper.join(timeout=10)
        set_num_threads(None)
    assert not failures, failures[0]
