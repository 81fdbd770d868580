"""Build and run generated C: find the compiler, compile into a content-addressed cache, load.

Typical use::

    result = build(source, "gemm_f32_ab12cd34")   # BuildResult(path, key, cached, seconds)
    lib = load(result.path)                       # ctypes.CDLL, once per path and process
    lib.gemm_f32_ab12cd34(..., get_num_threads())
"""

from chainfuse.runtime.cache import (
    BuildResult,
    build,
    build_recipe,
    cache_key,
    entry_path,
    files_fingerprint,
)
from chainfuse.runtime.files import write_atomic
from chainfuse.runtime.threads import (
    get_num_threads,
    num_threads,
    requested_num_threads,
    set_num_threads,
)
from chainfuse.runtime.toolchain import (
    BASE_FLAGS,
    INSTALL_HINT,
    CompileError,
    Compiler,
    CompilerFamily,
    CompilerNotFoundError,
    find_compiler,
    flags,
    load,
)

__all__ = [
    "BASE_FLAGS",
    "INSTALL_HINT",
    "BuildResult",
    "CompileError",
    "Compiler",
    "CompilerFamily",
    "CompilerNotFoundError",
    "build",
    "build_recipe",
    "cache_key",
    "entry_path",
    "files_fingerprint",
    "find_compiler",
    "flags",
    "get_num_threads",
    "load",
    "num_threads",
    "requested_num_threads",
    "set_num_threads",
    "write_atomic",
]
