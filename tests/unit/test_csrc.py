"""Every fixed C file of `chainfuse/codegen/csrc/` compiles on its own (its standalone prologue
supplies what a generated source defines before it), and loads without that prologue."""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from chainfuse.codegen.common import PROLOGUE_END, c_source

CSRC = Path(str(resources.files("chainfuse") / "codegen" / "csrc"))
FILES = sorted(p.name for p in CSRC.glob("*.c"))
FLAGS = ("-mavx2", "-mfma", "-mf16c", "-Werror=implicit-function-declaration")


def test_there_are_csrc_files() -> None:
    assert {"math.c", "half.c", "conv_runtime.c"} <= set(FILES)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this host")
@pytest.mark.parametrize("name", FILES)
def test_csrc_file_compiles_alone(name: str) -> None:
    done = subprocess.run(
        ["gcc", "-fsyntax-only", *FLAGS, "-c", str(CSRC / name)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", FILES)
def test_loaded_source_has_no_prologue(name: str) -> None:
    text = (CSRC / name).read_text(encoding="utf-8")
    body = c_source(name)
    assert PROLOGUE_END not in body and text.endswith(body)
