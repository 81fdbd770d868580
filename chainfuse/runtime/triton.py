"""Load generated Triton source as a Python module from the kernel cache directory.

The source is written once to `<cache dir>/triton/<name>.py` (atomically; its name carries the
hash of its spec, so a file there is the same source) and imported from that file, because
`triton.jit` reads a kernel's source from its module's file. Triton compiles and caches the
binaries itself (`TRITON_CACHE_DIR`, default `~/.triton/cache`), one per block configuration.

`interpret=True` loads the module with `TRITON_INTERPRET=1` in force while its decorators run,
so the kernel runs on CPU tensors under Triton's interpreter; the compiled and the interpreted
function of one source are kept apart. Triton decides once, when it is first imported, whether
its own language functions are interpreted: a process that imported triton without
`TRITON_INTERPRET=1` (a GPU process, PyTorch's inductor) cannot interpret, and says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from chainfuse.config import cache_dir
from chainfuse.runtime.files import write_atomic

__all__ = ["INSTALL_HINT", "interpreter_ready", "launch", "load_triton", "triton_available"]

INSTALL_HINT = "pip install 'chainfuse[gpu]' (triton==3.9.0)"

_loaded: dict[tuple[str, bool], Callable[..., Any]] = {}
_lock = threading.Lock()


def triton_available() -> bool:
    """Whether `import triton` would succeed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_ready() -> bool:
    """Whether Triton's interpreter can run here: triton is first imported now with
    `TRITON_INTERPRET=1` (its standard library is decorated once, at import), or already was."""
    if "triton" not in sys.modules:
        with _interpreting(True):
            import triton.language  # noqa: F401
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].sum, InterpretedFunction)


def load_triton(source: str, name: str, interpret: bool) -> Callable[..., Any]:
    """The jitted kernel `name` defined by `source` (once per name, mode and process)."""
    key = (name, interpret)
    with _lock:
        found = _loaded.get(key)
        if found is not None:
            return found
        if not triton_available():
            raise ModuleNotFoundError(f"the GPU target needs Triton: {INSTALL_HINT}")
        if interpret and not interpreter_ready():
            raise RuntimeError(
                "Triton was imported in this process without TRITON_INTERPRET=1, so its "
                "interpreter cannot run (its language functions are compiled-mode ones): set "
                "TRITON_INTERPRET=1 before anything imports triton to run the Triton kernels on "
                "CPU tensors"
            )
        folder = cache_dir() / "triton"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.py"
        data = source.encode()
        if not path.is_file() or path.read_bytes() != data:
            write_atomic(path, data)
        module_name = f"chainfuse_triton_{name}_{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with _interpreting(interpret):
            spec.loader.exec_module(module)
        kernel: Callable[..., Any] = getattr(module, name)
        _loaded[key] = kernel
        return kernel


@contextlib.contextmanager
def _interpreting(interpret: bool) -> Iterator[None]:
    """`TRITON_INTERPRET` set to `interpret` for the duration (Triton reads it when it decorates
    a kernel and again in modules it imports while an interpreted kernel runs)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def launch(
    kernel: Any, grid: tuple[int, ...], args: list[Any], meta: dict[str, int], interpret: bool
) -> None:
    """Run `kernel[grid](*args, **meta)`; interpreted kernels with `TRITON_INTERPRET=1` in force."""
    if interpret:
        with _lock, _interpreting(True):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
