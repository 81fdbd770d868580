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

import contextlib
import ctypes
import enum
import functools
import json
import os
import shlex
import shutil
import signal
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
    "CompilerTimeoutError",
    "find_compiler",
    "flags",
    "load",
    "run_compiler",
    "sanitize_flags",
    "toolchain",
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


class CompilerTimeoutError(RuntimeError):
    """A compiler run took longer than ``CHAINFUSE_CC_TIMEOUT`` seconds and was killed."""


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
    """One C compiler: its absolute path, family, ``major.minor.patch`` version, and the
    arguments ``CC`` gave it (``CC="gcc -O2"``), passed before every build's own flags."""

    path: str
    family: CompilerFamily
    version: str
    args: tuple[str, ...] = ()

    @property
    def command(self) -> tuple[str, ...]:
        """The command line's start: the path and `args`."""
        return (self.path, *self.args)


def find_compiler() -> Compiler:
    """The compiler to use: ``CC`` if set, else the first of cc, gcc, clang on ``PATH``.

    An explicit ``CC`` that does not name a GCC-compatible compiler is an error rather than a
    silent fall-back to another compiler: the user asked for that one.
    """
    override = config.cc_override()
    if override is not None:
        try:
            words = shlex.split(override)
        except ValueError as err:
            raise CompilerNotFoundError(f"{config.ENV_CC}={override!r}: {err}") from None
        path = shutil.which(words[0]) if words else None
        if path is None:
            raise CompilerNotFoundError(
                f"{config.ENV_CC}={override!r} is not an executable on PATH; {INSTALL_HINT}"
            )
        try:
            return _identify(os.path.abspath(path), tuple(words[1:]))
        except CompilerNotFoundError as err:
            raise CompilerNotFoundError(f"{config.ENV_CC}={override!r}: {err}") from None
    for candidate in ("cc", "gcc", "clang"):
        path = shutil.which(candidate)
        if path is None:
            continue
        try:
            return _identify(os.path.abspath(path))
        except CompilerNotFoundError:
            continue
    raise CompilerNotFoundError(f"no C compiler (cc, gcc or clang) found on PATH; {INSTALL_HINT}")


def toolchain(
    isa_flags: Iterable[str] = (),
) -> tuple[Compiler, tuple[str, ...], CompilerNotFoundError | None]:
    """The compiler and `flags` of a build, and None; or, when no compiler is found, the last one
    found for this ``CC`` (remembered in the cache) and the error: a kernel already cached under
    its key still loads, and only a build needing the compiler raises the error."""
    override = config.cc_override() or ""
    try:
        cc = find_compiler()
    except CompilerNotFoundError as err:
        last = _facts().get(f"last:{override}")
        if not (isinstance(last, list) and len(last) == 5 and isinstance(last[4], bool)):
            raise
        try:
            cc = Compiler(str(last[0]), CompilerFamily(last[2]), str(last[3]),
                          tuple(str(a) for a in last[1]))  # fmt: skip
        except (TypeError, ValueError):
            raise err from None
        return cc, _flags(last[4], isa_flags), err
    omp = _openmp_works(cc)
    _note_last(override, cc, omp)
    return cc, _flags(omp, isa_flags), None


@functools.cache
def _note_last(override: str, cc: Compiler, omp: bool) -> None:
    value = [cc.path, list(cc.args), cc.family.value, cc.version, omp]
    if _facts().get(f"last:{override}") != value:
        _store(f"last:{override}", value)


def run_compiler(command: Iterable[str]) -> subprocess.CompletedProcess[str]:
    """Run a compiler command, killed (with its children: gcc's cc1, as) after
    ``CHAINFUSE_CC_TIMEOUT`` seconds, which raises `CompilerTimeoutError`."""
    command = tuple(command)
    timeout = config.cc_timeout()
    with subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to kill the compiler's children too
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise CompilerTimeoutError(
                f"the C compiler did not finish within {timeout:g} s and was killed (set "
                f"{config.ENV_CC_TIMEOUT} to allow longer); command: {shlex.join(command)}"
            ) from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _facts_path() -> Path:
    return config.cache_dir() / "toolchain.json"


def _facts() -> dict[str, Any]:
    """toolchain.json's facts; {} when it is missing, unreadable or not a JSON object."""
    try:
        facts = json.loads(_facts_path().read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return facts if isinstance(facts, dict) else {}


def _store(key: str, value: Any) -> None:
    facts = _facts()
    facts[key] = value
    path = _facts_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(facts).encode())
    except OSError:
        pass  # an unwritable cache just means probing again


def _remembered(key: str, compute: Callable[[], Any], valid: Callable[[Any], bool]) -> Any:
    """A fact about the toolchain, kept on disk so a new process need not run the compiler.

    `key` names the compiler binary by real path, size and modification time, so an upgraded
    compiler is probed again. A missing, damaged or foreign fact (`valid` says) is probed again
    and rewritten; an unreadable or unwritable cache just means probing again.
    """
    value = _facts().get(key)
    if value is not None and valid(value):
        return value
    value = compute()
    _store(key, value)
    return value


def _binary_key(path: str, what: str, args: tuple[str, ...] = ()) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    spelled = f" {shlex.join(args)}" if args else ""
    return f"{what}:{real}{spelled}:{st.st_size}:{st.st_mtime_ns}"


def _an_identity(value: Any) -> bool:
    families = {f.value for f in CompilerFamily}
    return isinstance(value, list) and len(value) == 2 and value[0] in families and (
        isinstance(value[1], str)
    )  # fmt: skip


@functools.cache
def _identify(path: str, args: tuple[str, ...] = ()) -> Compiler:
    """Family and version from the compiler's predefined macros (works for gcc and clang)."""
    try:
        key = _binary_key(path, "identify", args)
    except OSError as err:
        raise CompilerNotFoundError(f"cannot run {path!r} ({err}); {INSTALL_HINT}") from err
    found = _remembered(key, lambda: list(_probe_identity(path, args)), _an_identity)
    return Compiler(path=path, family=CompilerFamily(found[0]), version=found[1], args=args)


def _probe_identity(path: str, args: tuple[str, ...] = ()) -> tuple[str, str]:
    try:
        done = run_compiler([path, *args, "-dM", "-E", "-x", "c", os.devnull])
    except CompilerTimeoutError as err:
        raise CompilerNotFoundError(f"{path!r} did not answer as a C compiler: {err}") from None
    except OSError as err:
        raise CompilerNotFoundError(f"cannot run {path!r} ({err}); {INSTALL_HINT}") from err
    macros: dict[str, str] = {}
    for line in done.stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2] if len(parts) == 3 else ""
    if done.returncode != 0 or "__GNUC__" not in macros:
        said = (done.stderr.strip() or done.stdout.strip())[:200]
        raise CompilerNotFoundError(
            f"{path!r} is not a GCC-compatible C compiler: `-dM -E` exited {done.returncode} "
            f"without defining __GNUC__ (it said {said!r}); {INSTALL_HINT}"
        )
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
    return _flags(_openmp_works(compiler), isa_flags)


def _flags(openmp: bool, isa_flags: Iterable[str]) -> tuple[str, ...]:
    omp = (OPENMP_FLAG,) if openmp else ()
    return BASE_FLAGS + omp + tuple(isa_flags) + sanitize_flags()


def sanitize_flags() -> tuple[str, ...]:
    """``-fsanitize=...`` flags of ``CHAINFUSE_SANITIZE`` (none when it is unset): frame
    pointers for readable reports, undefined behaviour aborts instead of printing on, and -O1
    (instrumented -O3 compiles several times slower; every load and store is checked either way)."""
    names = config.sanitizers()
    if not names:
        return ()
    extra = ("-fno-sanitize-recover=undefined",) if "undefined" in names else ()
    return ("-O1", f"-fsanitize={','.join(names)}", "-fno-omit-frame-pointer", *extra)


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
    key = _binary_key(compiler.path, "openmp", compiler.args)
    ok = bool(_remembered(key, lambda: _probe_openmp(compiler), lambda v: isinstance(v, bool)))
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
        command = [*compiler.command, *BASE_FLAGS, OPENMP_FLAG, "-o", str(Path(tmp) / "probe.so")]
        try:
            done = run_compiler([*command, str(src)])
        except OSError:
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
