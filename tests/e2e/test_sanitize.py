"""CHAINFUSE_SANITIZE builds kernels with AddressSanitizer and UndefinedBehaviorSanitizer, into
their own cache entries; with the runtimes preloaded (scripts/sanitize.sh) an out-of-bounds write
or undefined behaviour in C aborts with a report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import chainfuse
from chainfuse import config
from chainfuse.runtime import build, cache_key, find_compiler, flags

REPO = Path(chainfuse.__file__).resolve().parents[1]
SOURCE = textwrap.dedent("""
    void write_at(int *p, long i) { p[i] = 1; }
    int shift(int x, int s) { return x << s; }
""")


def _runtimes() -> list[str]:
    gcc = shutil.which("gcc")
    if gcc is None:
        return []
    found = []
    for lib in ("libasan.so", "libubsan.so"):
        path = subprocess.run([gcc, f"-print-file-name={lib}"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        if not os.path.isabs(path):
            return []
        found.append(path)
    return found


def test_sanitize_flags_make_a_separate_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    cc = find_compiler()
    plain = flags(cc)
    monkeypatch.setenv(config.ENV_SANITIZE, "address, undefined")
    sanitized = flags(cc)
    assert "-fsanitize=address,undefined" in sanitized and "-fsanitize" not in " ".join(plain)
    assert "-fno-sanitize-recover=undefined" in sanitized
    assert cache_key(SOURCE, cc, plain) != cache_key(SOURCE, cc, sanitized)
    monkeypatch.setenv(config.ENV_SANITIZE, "address,thread-ish")
    with pytest.raises(ValueError, match=r"CHAINFUSE_SANITIZE='address,thread-ish'.*thread-ish"):
        build(SOURCE, "sanitized")


@pytest.mark.skipif(not _runtimes(), reason="needs gcc's libasan and libubsan")
@pytest.mark.parametrize("fault", ["heap-buffer-overflow", "shift exponent"])
def test_a_sanitized_build_reports_faults_in_c(fault: str) -> None:
    call = "lib.write_at(a.ctypes.data, 4)" if fault.startswith("heap") else "lib.shift(1, 40)"
    code = textwrap.dedent(f"""
        import ctypes
        import numpy as np
        from chainfuse.runtime import build, load
        lib = load(build({SOURCE!r}, "sanitized").path)
        lib.write_at.argtypes = [ctypes.c_void_p, ctypes.c_long]
        a = np.zeros(4, dtype=np.int32)
        lib.write_at(a.ctypes.data, 3)  # in bounds: fine
        print("in bounds", flush=True)
        {call}
        print("not caught", flush=True)
    """)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        LD_PRELOAD=":".join(_runtimes()),
        ASAN_OPTIONS="detect_leaks=0",
        CHAINFUSE_SANITIZE="address,undefined",
    )
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert child.stdout.split("\n")[0] == "in bounds", child.stderr
    assert "not caught" not in child.stdout and child.returncode != 0
    assert fault in child.stderr
