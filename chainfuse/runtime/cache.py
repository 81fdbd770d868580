"""Content-addressed on-disk cache of compiled kernels.

An entry is keyed by the sha256 of everything its machine code depends on: the source, the
compiler (path, family, version), the flags, chainfuse's version, and the host CPU (because the
flags say ``-march=native``). Layout::

    <cache_dir>/<key[:2]>/<name>_<key[:16]>.so          the shared object
    <cache_dir>/<key[:2]>/<name>_<key[:16]>.so.sha256   digest of the .so (proves it is complete)
    <cache_dir>/<key[:2]>/<name>_<key[:16]>.c           the source it was built from
    <cache_dir>/<key[:2]>/<name>_<key[:16]>.so.lock     serialises builders of this entry
    <cache_dir>/recipes/<r[:2]>/<r[:32]>.key            an entry's key by the digest r of what
                                                        its source was generated from
    <cache_dir>/pch/<h[:24]>/cf_system.h(.gch, .size)   the system headers of sources built
                                                        with compiler and flags h, precompiled
                                                        by gcc (`_SystemHeader`)

An entry is keyed on the code only: a source's opening comment is left out of the key (a
generated kernel's header names the chain's sizes and scale, which are run-time arguments).

`build_recipe` is `build` for a source that a recipe determines (the generated kernels: a spec's
name, which spells every field the code depends on; not the header comment): a process that
finds the recipe's entry loads it without generating the source again (a cost of every warm
start) and generates it only to compile. The recipe's digest also covers the generator's own
files (their sizes and modification times, as Python's bytecode cache does), so a changed
generator builds again.

Writes are atomic (a temp file in the same directory, then `os.replace`), so a reader sees a whole
file or none. Concurrent builders of one entry (threads or processes) serialise on a
`filelock.FileLock`; the second finds the first's result and does not compile. An entry whose
digest does not match (truncated, emptied, corrupted on disk) is rebuilt. The digest is checked
instead of trying ``dlopen``: a truncated ELF can map and then fault (SIGBUS) on first use.

A cache directory that cannot be written falls back to a private temporary directory, with one
warning per process and path, removed when the process exits (or, if it was killed, by the next
process that falls back); a read-only directory that already holds the entry is still used.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import filelock

from chainfuse import config
from chainfuse.runtime.files import write_atomic
from chainfuse.runtime.toolchain import (
    CompileError,
    Compiler,
    CompilerFamily,
    CompilerNotFoundError,
    CompilerTimeoutError,
    flags,
    run_compiler,
    toolchain,
)

__all__ = [
    "BuildResult",
    "build",
    "build_recipe",
    "cache_key",
    "code_of",
    "entry_path",
    "files_fingerprint",
]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_LIBS = ("-lm",)


@dataclass(frozen=True)
class BuildResult:
    """Where a kernel's shared object is, its cache key, and what building it cost."""

    path: Path
    key: str
    cached: bool
    seconds: float

    @property
    def source_path(self) -> Path:
        """The C source saved next to the shared object."""
        return self.path.with_suffix(".c")


def build(
    source: str,
    name: str,
    extra_flags: Iterable[str] = (),
    *,
    compiler: Compiler | None = None,
) -> BuildResult:
    """Compile ``source`` into a shared object named after ``name``, or reuse the cached one.

    ``name`` is a C identifier (it becomes part of a file name); ``extra_flags`` are appended to
    `chainfuse.runtime.toolchain.flags`. Raises `CompileError` with the compiler's stderr and the path of
    the saved source when the compiler fails, `CompilerNotFoundError` when there is none.
    """
    start = time.perf_counter()
    if not _NAME.fullmatch(name):
        raise ValueError(f"kernel name {name!r} must be a C identifier of at most 128 characters")
    cc, build_flags, missing = _toolchain(compiler, extra_flags)
    key = cache_key(source, cc, build_flags)
    dump = config.dump_dir()
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        write_atomic(dump / f"{name}_{key[:16]}.c", source.encode())

    preferred = config.cache_dir()
    so = entry_path(preferred, name, key)
    if _valid(so):
        return BuildResult(so, key, True, time.perf_counter() - start)
    if missing is not None:
        raise missing  # (a cached entry needs no compiler)
    root = _writable_root(preferred)
    if root != preferred:
        so = entry_path(root, name, key)
    so.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{so}.lock"):
        cached = _valid(so)  # another process may have built it while we waited
        if not cached:
            _compile(cc, build_flags, source, so)
    return BuildResult(so, key, cached, time.perf_counter() - start)


def build_recipe(
    recipe: str,
    name: str,
    make_source: Callable[[], str],
    extra_flags: Iterable[str] = (),
    *,
    compiler: Compiler | None = None,
) -> BuildResult:
    """`build` of ``make_source()``, a source that ``recipe`` determines, without calling
    ``make_source`` when the entry the recipe names is already valid in the cache (module
    docstring). With ``CHAINFUSE_DUMP`` set the source is always generated, to be dumped."""
    start = time.perf_counter()
    extra = tuple(extra_flags)
    cc, build_flags, missing = _toolchain(compiler, extra)
    payload = {
        "recipe": recipe,
        "generator": _generator_fingerprint(),
        "compiler": [*cc.command, cc.family.value, cc.version],
        "flags": list(build_flags) + list(_LIBS),
        "host": _host_fingerprint(),
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    preferred = config.cache_dir()
    index = preferred / "recipes" / digest[:2] / f"{digest[:32]}.key"
    if config.dump_dir() is None:
        try:
            # bytes decoded, not read_text(encoding="ascii"): that imports the ascii codec in
            # the first call of every new process
            key = index.read_bytes().decode("utf-8", errors="replace").strip()
        except (OSError, ValueError):
            key = ""
        if len(key) == 64 and not key.strip("0123456789abcdef"):  # (no regex compiled per process)
            so = entry_path(preferred, name, key)
            if _valid(so):
                return BuildResult(so, key, True, time.perf_counter() - start)
    result = build(make_source(), name, extra, compiler=None if missing else cc)
    if result.path.parent.parent == preferred:  # (not an entry of the fallback directory)
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(index, result.key.encode())
        except OSError:
            pass  # an unwritable cache only costs generating the source next time
    return BuildResult(result.path, result.key, result.cached, time.perf_counter() - start)


def _toolchain(
    compiler: Compiler | None, extra_flags: Iterable[str]
) -> tuple[Compiler, tuple[str, ...], CompilerNotFoundError | None]:
    if compiler is not None:
        return compiler, flags(compiler, extra_flags), None
    return toolchain(extra_flags)


@functools.cache
def _generator_fingerprint() -> str:
    """Sizes and modification times of the code generators' files (codegen, kernels) and
    chainfuse's version: what a recipe's source also depends on."""
    root = Path(__file__).parent.parent  # the package's folder
    files: list[Path] = []
    for folder in ("codegen", "codegen/csrc", "kernels"):
        try:
            entries = sorted(os.scandir(root / folder), key=lambda e: e.name)
        except OSError:
            continue
        files += [Path(e.path) for e in entries if e.is_file() and e.name.endswith((".py", ".c"))]
    return files_fingerprint(files)


def files_fingerprint(files: Iterable[Path]) -> str:
    """A digest of chainfuse's version and the names, sizes and modification times of `files`
    (what Python's bytecode cache trusts): a changed file changes it, without reading any."""
    parts = [config.VERSION]
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            parts.append(f"{path.parent.name}/{path.name}:missing")
            continue
        parts.append(f"{path.parent.name}/{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cache_key(source: str, compiler: Compiler, build_flags: Iterable[str]) -> str:
    """Hex sha256 of everything the compiled object depends on: the source without its opening
    comment (a generated kernel's header names sizes and scales the code does not depend on,
    so one structure compiles once), the compiler, the flags, the version and the host."""
    payload = {
        "source": code_of(source),
        "compiler": [*compiler.command, compiler.family.value, compiler.version],
        "flags": list(build_flags) + list(_LIBS),
        "chainfuse": config.VERSION,
        "host": _host_fingerprint(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def code_of(source: str) -> str:
    """`source` without the block comment it opens with, if any: what the compiler reads."""
    if source.startswith("/*"):
        end = source.find("*/")
        if end >= 0:
            return source[end + 2 :]
    return source


def entry_path(root: Path, name: str, key: str) -> Path:
    """Path of the shared object of entry ``key`` under cache root ``root``."""
    return root / key[:2] / f"{name}_{key[:16]}.so"


def _digest_path(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _valid(so: Path) -> bool:
    """True when ``so`` exists, is not empty and matches the digest written with it."""
    try:
        if so.stat().st_size == 0:
            return False
        return _digest_path(so).read_text().strip() == _sha256(so)
    except OSError:
        return False


def _compile(cc: Compiler, build_flags: tuple[str, ...], source: str, so: Path) -> None:
    src = so.with_suffix(".c")
    write_atomic(src, source.encode())
    fd, tmp_name = tempfile.mkstemp(dir=so.parent, prefix=f".{so.stem}.", suffix=".so.tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    header = _SystemHeader(cc, build_flags, source, so.parent.parent)
    output = ("-o", str(tmp), str(src), *_LIBS)
    command = (*cc.command, *build_flags, *header.flags(), *output)
    try:
        done = _run(command, src)
        if done.returncode != 0 and header.flags():
            # again without the precompiled header; if that builds, gcc could not read the
            # header (corrupted on disk): drop it
            command = (*cc.command, *build_flags, *output)
            done = _run(command, src)
            if done.returncode == 0:
                header.discard()
        if done.returncode != 0:
            raise CompileError(
                f"{cc.family.value} {cc.version} failed (exit {done.returncode}) on {src}:\n"
                f"{done.stderr.strip()}\ncommand: {' '.join(command)}",
                stderr=done.stderr,
                source_path=src,
                command=command,
            )
        write_atomic(_digest_path(so), _sha256(tmp).encode())
        os.replace(tmp, so)
    finally:
        tmp.unlink(missing_ok=True)
        header.finish()


def _run(command: tuple[str, ...], src: Path) -> subprocess.CompletedProcess[str]:
    try:
        return run_compiler(command)
    except CompilerTimeoutError as err:
        raise CompileError(f"{err} (source {src})", stderr="", source_path=src,
                           command=command) from None  # fmt: skip


_INCLUDE = re.compile(r"^#include <[A-Za-z0-9_./]+>$", re.MULTILINE)
# a reserved macro (``_POSIX_C_SOURCE``, ``_GNU_SOURCE``) changes what the system headers declare:
# those must be parsed after it, as the source has them
_RESERVED = re.compile(r"^\s*#\s*define\s+_", re.MULTILINE)


class _SystemHeader:
    """The system headers a source includes, precompiled by gcc once per compiler, flags and set
    of headers, under ``<cache root>/pch/``, and handed to later builds with ``-include``.

    Parsing ``<immintrin.h>`` (46,000 lines) is a third of a kernel's compile here (0.8 of
    2.6 s). The second build that finds no precompiled header (the first only notes that one
    is wanted, so that a first compile in an empty cache costs what it did) starts gcc on it
    next to its own compile (a second core does it in the compile's shadow) and installs it
    atomically when both are done; a build that cannot take the header's lock at once
    (another process is making it) compiles without. The headers keep their include guards,
    so the source's own ``#include`` lines then cost nothing. Not for clang (its precompiled
    headers take other flags), nor for a source that defines a reserved macro (a feature-test
    macro must precede the headers it changes).
    """

    def __init__(self, cc: Compiler, build_flags: tuple[str, ...], source: str, root: Path):
        self._use: tuple[str, ...] = ()
        self._making: tuple[subprocess.Popen[bytes], Path, filelock.FileLock] | None = None
        includes = sorted(set(_INCLUDE.findall(source)))
        if cc.family is not CompilerFamily.GCC or not includes or _RESERVED.search(source):
            return
        text = "\n".join(includes) + "\n"
        payload = [*cc.command, cc.version, list(build_flags), text, _host_fingerprint()]
        key = hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:24]
        self._header = root / "pch" / key / "cf_system.h"
        self._gch = self._header.with_name(self._header.name + ".gch")
        self._size = self._header.with_name(self._header.name + ".gch.size")
        if self._whole():
            self._use = ("-include", str(self._header))
            return
        wanted = self._header.with_name("wanted")
        try:
            self._header.parent.mkdir(parents=True, exist_ok=True)
            if not wanted.exists():  # the first build: a cache that builds one kernel only
                wanted.touch()  # never pays for the header (25 MiB, 1.4 s of a core)
                return
            lock = filelock.FileLock(f"{self._gch}.lock")
            lock.acquire(timeout=0)
        except (OSError, filelock.Timeout):
            return  # unwritable, or another process is making it: compile without
        if self._whole():  # made while we looked
            lock.release()
            self._use = ("-include", str(self._header))
            return
        tmp: Path | None = None
        try:
            write_atomic(self._header, text.encode())
            fd, name = tempfile.mkstemp(dir=self._header.parent, suffix=".gch.tmp")
            os.close(fd)
            tmp = Path(name)
            flags = [f for f in build_flags if f != "-shared"]
            command = [*cc.command, *flags, "-x", "c-header", "-o", name, str(self._header)]
            process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        except OSError:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            lock.release()
            return
        self._making = (process, tmp, lock)

    def _whole(self) -> bool:
        """The header is there with the size recorded when it was made (gcc reads a damaged
        one as no header at all, so a bad one would only cost every later build its parse)."""
        try:
            return self._gch.stat().st_size == int(self._size.read_text())
        except (OSError, ValueError):
            return False

    def flags(self) -> tuple[str, ...]:
        """What the build's command line takes: ``-include`` of the header, or nothing."""
        return self._use

    def discard(self) -> None:
        """Remove a precompiled header the compiler rejected."""
        self._use = ()
        with contextlib.suppress(OSError):
            self._size.unlink(missing_ok=True)
            self._gch.unlink(missing_ok=True)

    def finish(self) -> None:
        """Wait for a header being made by this build and install it if gcc made it."""
        if self._making is None:
            return
        process, tmp, lock = self._making
        self._making = None
        try:
            if process.wait(timeout=config.cc_timeout()) == 0:
                os.replace(tmp, self._gch)
                write_atomic(self._size, str(self._gch.stat().st_size).encode())
        except OSError:
            pass
        except subprocess.TimeoutExpired:
            process.kill()  # (a hung compiler: the build itself already failed or finished)
            process.wait()
        finally:
            tmp.unlink(missing_ok=True)
            lock.release()


def _writable_root(preferred: Path) -> Path:
    """``preferred`` if we can create files in it, else this process's fallback directory."""
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=preferred, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError:
        return _fallback_root(str(preferred))
    return preferred


_FALLBACK = "chainfuse-fallback-"


@functools.cache
def _fallback_root(unwritable: str) -> Path:
    """A private temporary cache for this process, removed when it exits; those left by
    processes that died without exiting (killed) are removed here, by the next one."""
    _remove_stale_fallbacks()
    root = Path(tempfile.mkdtemp(prefix=f"{_FALLBACK}{os.getpid()}-"))
    atexit.register(_remove_fallback, root, os.getpid())
    warnings.warn(
        f"chainfuse cache directory {unwritable} is not writable; compiled kernels go to {root} "
        f"for this process (set {config.ENV_CACHE_DIR} to a writable directory to keep them)",
        RuntimeWarning,
        stacklevel=4,
    )
    return root


def _remove_fallback(root: Path, owner: int) -> None:
    if os.getpid() == owner:  # (not in a forked child, which inherits the exit handler)
        shutil.rmtree(root, ignore_errors=True)


def _remove_stale_fallbacks() -> None:
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(_FALLBACK):
            continue
        pid = entry.name[len(_FALLBACK) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # (another user's process: not ours to judge)
    return True


@functools.cache
def _host_fingerprint() -> str:
    """What ``-march=native`` resolves against: the CPU model and its feature flags.

    Not `platform.processor()`: on Linux it runs ``uname -p`` in a subprocess (in every
    warm start) and adds nothing /proc/cpuinfo does not say."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                if field.strip() in ("model name", "flags", "Features", "CPU part"):
                    parts.append(value.strip())
                if not line.strip() and len(parts) > 2:
                    break  # the first processor describes them all
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
