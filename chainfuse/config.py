"""Every knob and environment variable of chainfuse, typed, in one place.

Each knob is a function that reads the environment when it is called, so a test can
`monkeypatch.setenv` and a long-lived process sees a changed variable without a reload. Nothing
here caches or mutates state; the modules that act on a knob (`runtime`, ...) own that.

=======================  ========================================================================
variable                 meaning
=======================  ========================================================================
``CHAINFUSE_CACHE_DIR``  where compiled kernels are cached (default: the user cache directory)
``CHAINFUSE_DUMP``       a directory that receives a copy of every generated source
``CC``                   the C compiler, with arguments if any (``CC="gcc -O2"``; default: the
                         first of cc, gcc, clang on ``PATH``)
``CHAINFUSE_CC_TIMEOUT`` seconds a compiler run may take before it is killed and the build fails
                         (default 300)
``CHAINFUSE_SANITIZE``   sanitizers to build kernels with, e.g. ``address,undefined``: adds
                         ``-fsanitize=...`` (a separate cache entry); loading such a kernel needs
                         the sanitizer runtime preloaded (``scripts/sanitize.sh``)
``CHAINFUSE_BACKEND``    ``auto`` (default: CUDA tensors run the Triton kernels, CPU tensors the C
                         ones) or ``triton`` (torch CPU tensors too, under Triton's interpreter)
``OMP_NUM_THREADS``      default thread count of generated kernels (else the CPUs we may run on);
                         a value that is not a positive integer is ignored with a warning
``OMP_WAIT_POLICY``      set to ``PASSIVE`` by the runtime unless already set (`runtime.toolchain`)
=======================  ========================================================================
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import platformdirs

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "ENV_CACHE_DIR",
    "ENV_CC",
    "ENV_CC_TIMEOUT",
    "ENV_DUMP",
    "ENV_NUM_THREADS",
    "ENV_SANITIZE",
    "ENV_WAIT_POLICY",
    "VERSION",
    "backend",
    "cache_dir",
    "cc_override",
    "cc_timeout",
    "default_num_threads",
    "dump_dir",
    "sanitizers",
]

#: chainfuse's version (pyproject.toml's): part of every cache key, so a release builds anew
VERSION = "0.1.0"

ENV_CACHE_DIR = "CHAINFUSE_CACHE_DIR"
ENV_DUMP = "CHAINFUSE_DUMP"
ENV_CC = "CC"
ENV_CC_TIMEOUT = "CHAINFUSE_CC_TIMEOUT"
ENV_SANITIZE = "CHAINFUSE_SANITIZE"
ENV_NUM_THREADS = "OMP_NUM_THREADS"
ENV_WAIT_POLICY = "OMP_WAIT_POLICY"
ENV_BACKEND = "CHAINFUSE_BACKEND"
BACKENDS = ("auto", "triton")


def _env(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def cache_dir() -> Path:
    """Root of the on-disk kernel cache: ``CHAINFUSE_CACHE_DIR``, else the user cache dir."""
    value = _env(ENV_CACHE_DIR)
    return Path(value).expanduser() if value else Path(platformdirs.user_cache_dir("chainfuse"))


def dump_dir() -> Path | None:
    """Directory that receives a copy of every generated source (``CHAINFUSE_DUMP``), or None."""
    value = _env(ENV_DUMP)
    return Path(value).expanduser() if value else None


def cc_override() -> str | None:
    """The C compiler the user asked for with ``CC`` (a name on ``PATH`` or a path), or None."""
    return _env(ENV_CC)


def cc_timeout() -> float:
    """Seconds one run of the compiler may take (``CHAINFUSE_CC_TIMEOUT``, default 300): a hung
    compiler fails the build instead of hanging the process."""
    value = _env(ENV_CC_TIMEOUT)
    if value is None:
        return 300.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{ENV_CC_TIMEOUT}={value!r} is not a positive number of seconds")
    return seconds


#: what ``CHAINFUSE_SANITIZE`` may name (gcc's and clang's ``-fsanitize=`` spellings)
SANITIZERS = ("address", "undefined")


def sanitizers() -> tuple[str, ...]:
    """The sanitizers ``CHAINFUSE_SANITIZE`` asks kernels to be built with (comma-separated)."""
    value = _env(ENV_SANITIZE)
    if value is None:
        return ()
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        raise ValueError(
            f"{ENV_SANITIZE}={value!r}: unknown sanitizer(s) {unknown}; expected a comma list of"
            f" {', '.join(SANITIZERS)}"
        )
    return names


def default_num_threads() -> int:
    """Threads a generated kernel uses unless told otherwise.

    ``OMP_NUM_THREADS`` when it is set (its first entry: OpenMP allows a comma list of nested
    levels) to a positive integer (another value is ignored, with a warning once per value: every
    kernel call would fail otherwise, and OpenMP ignores it too), else the number of CPUs this process may run on (its affinity mask, which is what a
    container or ``taskset`` gives us, not the machine's core count).
    """
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and type(data) is dict:
        # os.environ's own dict (bytes to bytes on POSIX), which every write to os.environ
        # updates: `os.environ.get` of an unset variable raises and catches a KeyError inside,
        # and every kernel call asks
        raw = data.get(_NUM_THREADS_KEY)
        return _threads_from(None if raw is None else os.fsdecode(raw))
    return _threads_from(os.environ.get(ENV_NUM_THREADS))


_NUM_THREADS_KEY = os.fsencode(ENV_NUM_THREADS)


@functools.lru_cache(maxsize=8)
def _threads_from(raw: str | None) -> int:
    """`default_num_threads` for one value of the variable: every kernel call asks, so the
    parsing is done once per value (the variable is still read each time)."""
    value = (raw or "").strip() or None
    if value is not None:
        first = value.split(",")[0].strip()
        try:
            n = int(first)
        except ValueError:
            n = 0
        if n >= 1:
            return n
        warnings.warn(
            f"chainfuse: {ENV_NUM_THREADS}={value!r} is not a positive integer; ignored (kernels"
            f" use {_usable_cpus()} threads, the CPUs this process may run on)",
            RuntimeWarning,
            stacklevel=2,
        )
    return _usable_cpus()


@functools.cache
def _usable_cpus() -> int:
    """CPUs in this process's affinity mask, read once: it is a system call, and every kernel
    call asks (a change of affinity after the first call is not seen)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def backend() -> str:
    """`CHAINFUSE_BACKEND`: "auto" (unset or empty) or "triton"; anything else is an error."""
    value = (os.environ.get(ENV_BACKEND) or "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_BACKEND}={os.environ.get(ENV_BACKEND)!r}: expected one of {', '.join(BACKENDS)}"
        )
    return value
