"""The system C compiler: find it, choose its flags, load what it made.

Generated kernels are plain C11 with OpenMP *pragmas only* (``#pragma omp parallel for
num_threads(nt)``; never a call into ``omp.h``), so a kernel links against whichever OpenMP runtime
the compiler brings (gcc's libgomp or clang's libomp) and builds without OpenMP at all, serially.
The thread count reaches a kernel as an ordinary argument (see `runtime.threads`).

In-process state, kept on purpose and small: the identity of each compiler path and whether it
supports OpenMP are probed once per process (``functools.cache``); `load` keeps one `ctypes.CDLL`
per path (a shared object cannot be unloaded safely anyway).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chainfuse import config
from chainfuse.runtime.files import write_atomic

__all__ = [
    "INSTALL_HINT",
    "CompileError",
    "Compiler",
    "CompilerFamily",
    "CompilerNotFoundError",
    "find_compiler",
    "flags",
    "load",
]

INSTALL_HINT = (
    "chainfuse compiles its kernels with the system C compiler: install gcc or clang "
    "(e.g. `apt-get install gcc`, `dnf install gcc`, `xcode-select --install`) "
    f"or point the {config.ENV_CC} environment variable at one"
)

#: Flags of every kernel build. ``-ffp-contract=fast`` lets the compiler fuse ``a*b+c`` into an FMA
#: (what every BLAS does). ``-ffast-math`` is deliberately absent: it implies ``-ffinite-math-only``,
#: under which ``isnan``/``isinf`` fold to false and ``-inf`` mask entries (causal and boolean
#: attention masks) and NaN propagation silently break.
BASE_FLAGS: tuple[str, ...] = (
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-ffp-contract=fast",
    # no FP-exception semantics: lets the compiler if-convert (and so vectorise) the compares of
    # the softmax and the activations; results, NaN and inf handling are unchanged
    "-fno-trapping-math",
)
OPENMP_FLAG = "-fopenmp"


class CompilerNotFoundError(RuntimeError):
    """No usable C compiler; the message says how to get one."""


class CompileError(RuntimeError):
    """The compiler rejected a generated source; carries its stderr and the saved source."""

    def __init__(self, message: str, *, stderr: str, source_path: Path, command: tuple[str, ...]):
        super().__init__(message)
        self.stderr = stderr
        self.source_path = source_path
        self.command = command


class CompilerFamily(enum.Enum):
    """Compilers whose command line and C extensions (vector_size, pragmas) we rely on."""

    GCC = "gcc"
    CLANG = "clang"


@dataclass(frozen=True)
class Compiler:
    """One C compiler: its absolute path, family and ``major.minor.patch`` version."""

    path: str
    family: CompilerFamily
    version: str


def find_compiler() -> Compiler:
    """The compiler to use: ``CC`` if set, else the first of cc, gcc, clang on ``PATH``.

    An explicit ``CC`` that does not name a GCC-compatible compiler is an error rather than a
    silent fall-back to another compiler: the user asked for that one.
    """
    override = config.cc_override()
    if override is not None:
        path = shutil.which(override)
        if path is None:
            raise CompilerNotFoundError(
                f"{config.ENV_CC}={override!r} is not an executable on PATH; {INSTALL_HINT}"
            )
        return _identify(os.path.abspath(path))
    for candidate in ("cc", "gcc", "clang"):
        path = shutil.which(candidate)
        if path is None:
            continue
        try:
            return _identify(os.path.abspath(path))
        except CompilerNotFoundError:
            continue
    raise CompilerNotFoundError(f"no C compiler (cc, gcc or clang) found on PATH; {INSTALL_HINT}")


def _facts_path() -> Path:
    return config.cache_dir() / "toolchain.json"


def _remembered(key: str, compute: Callable[[], Any]) -> Any:
    """A fact about the toolchain, kept on disk so a new process need not run the compiler.

    `key` names the compiler binary by real path, size and modification time, so an upgraded
    compiler is probed again. An unreadable or unwritable cache just means probing again.
    """
    path = _facts_path()
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        facts = {}
    if key in facts:
        return facts[key]
    value = compute()
    facts[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(facts).encode())
    except OSError:
        pass
    return value


def _binary_key(path: str, what: str) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{what}:{real}:{st.st_size}:{st.st_mtime_ns}"


@functools.cache
def _identify(path: str) -> Compiler:
    """Family and version from the compiler's predefined macros (works for gcc and clang)."""
    try:
        key = _binary_key(path, "identify")
    except OSError as err:
        raise CompilerNotFoundError(f"cannot run {path!r} ({err}); {INSTALL_HINT}") from err
    found = _remembered(key, lambda: _probe_identity(path))
    return Compiler(path=path, family=CompilerFamily(found[0]), version=found[1])


def _probe_identity(path: str) -> tuple[str, str]:
    try:
        done = subprocess.run(
            [path, "-dM", "-E", "-x", "c", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise CompilerNotFoundError(f"cannot run {path!r} ({err}); {INSTALL_HINT}") from err
    macros: dict[str, str] = {}
    for line in done.stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2] if len(parts) == 3 else ""
    if done.returncode != 0 or "__GNUC__" not in macros:
        raise CompilerNotFoundError(f"{path!r} is not a GCC-compatible C compiler; {INSTALL_HINT}")
    if "__clang__" in macros:
        family = CompilerFamily.CLANG
        parts3 = ("__clang_major__", "__clang_minor__", "__clang_patchlevel__")
    else:
        family = CompilerFamily.GCC
        parts3 = ("__GNUC__", "__GNUC_MINOR__", "__GNUC_PATCHLEVEL__")
    version = ".".join(macros.get(p, "0") for p in parts3)
    return family.value, version


def flags(compiler: Compiler, isa_flags: Iterable[str] = ()) -> tuple[str, ...]:
    """Command-line flags of a kernel build: `BASE_FLAGS`, OpenMP if it works, then ``isa_flags``.

    ``isa_flags`` are what a micro-kernel needs beyond ``-march=native`` (e.g. ``-mavx512f`` to
    compile for another machine). A compiler without OpenMP (Apple clang without libomp) loses
    ``-fopenmp`` with one warning; the kernels then run serially, since they only use pragmas.
    """
    omp = (OPENMP_FLAG,) if _openmp_works(compiler) else ()
    return BASE_FLAGS + omp + tuple(isa_flags)


_OPENMP_PROBE = """\
int chainfuse_openmp_probe(int n) {
    int s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(2)
    for (int i = 0; i < n; ++i) s += i;
    return s;
}
"""


@functools.cache
def _openmp_works(compiler: Compiler) -> bool:
    ok = bool(_remembered(_binary_key(compiler.path, "openmp"), lambda: _probe_openmp(compiler)))
    if not ok:
        warnings.warn(
            f"{compiler.path} ({compiler.family.value} {compiler.version}) cannot build OpenMP "
            f"code; chainfuse kernels will run on one thread (install libomp or use gcc)",
            RuntimeWarning,
            stacklevel=3,
        )
    return ok


def _probe_openmp(compiler: Compiler) -> bool:
    with tempfile.TemporaryDirectory(prefix="chainfuse-omp-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(_OPENMP_PROBE)
        command = [compiler.path, *BASE_FLAGS, OPENMP_FLAG, "-o", str(Path(tmp) / "probe.so")]
        try:
            done = subprocess.run(
                [*command, str(src)], capture_output=True, text=True, timeout=120, check=False
            )
        except (OSError, subprocess.SubprocessError):
            ok = False
        else:
            ok = done.returncode == 0
    return ok


def load(path: str | os.PathLike[str]) -> ctypes.CDLL:
    """The shared object at ``path``, opened once per process and path.

    Before the first kernel is opened we default ``OMP_WAIT_POLICY`` to ``PASSIVE``: libgomp and
    libomp read it once, when they initialise, and by default their idle workers spin for a while
    after every parallel region; on a shared machine those spinning threads steal the cores that
    other libraries (BLAS, PyTorch) and processes are about to use, slowing them several times over.
    A user's own setting wins, and a runtime already initialised by another library keeps its own.
    """
    return _load(os.path.abspath(os.fspath(path)))


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    os.environ.setdefault(config.ENV_WAIT_POLICY, "PASSIVE")
    return ctypes.CDLL(path)
