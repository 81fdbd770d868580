"""The README's Python quick start runs as written; its two commands name real scripts that parse.

The scripts themselves are not run here (they create a virtual environment and install torch);
`.ci/run` runs the test command for real.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
COMMANDS = ("bash scripts/main.sh", "bash scripts/test.sh")
SCRIPTS = ("scripts/main.sh", "scripts/test.sh", "scripts/setup.sh", ".ci/run")
BASH = shutil.which("bash")


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _quick_start() -> str:
    """The README's first ```python block."""
    match = re.search(r"^```python\n(.*?)^```", _text(), re.S | re.M)
    assert match, "README.md has no ```python block: its quick start must be one"
    return match.group(1)


def test_quick_start_runs_and_checks_its_result(tmp_path: Path) -> None:
    """The quick start, run as a user would paste it (in a fresh interpreter, this repository
    on the path), builds its inputs, runs a kernel and checks it against the reference."""
    code = _quick_start()
    assert "reference" in code, "the quick start should check its result against the reference"
    path = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"README quick start failed:\n{code}\n{proc.stderr}"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_is_near_the_top(command: str) -> None:
    text = _text()
    assert command in text
    first_section = text.find("\n## ")
    assert text.index(command) < first_section, f"{command!r} should come before any section"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_names_an_executable_script(command: str) -> None:
    match = re.fullmatch(r"bash (\S+)", command)
    assert match
    script = ROOT / match.group(1)
    assert script.is_file()
    assert os.access(script, os.X_OK)
    assert script.read_text(encoding="utf-8").startswith("#!/usr/bin/env bash\n")


@pytest.mark.skipif(BASH is None, reason="bash not on PATH")
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script: str) -> None:
    assert BASH is not None
    proc = subprocess.run([BASH, "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", ("scripts/main.sh", "scripts/test.sh", ".ci/run"))
def test_scripts_fail_loudly_and_share_the_setup(script: str) -> None:
    text = (ROOT / script).read_text(encoding="utf-8")
    assert "set -euo pipefail" in text
    assert "setup.sh" in text or "scripts/test.sh" in text


def test_setup_pins_torch() -> None:
    text = (ROOT / "scripts/setup.sh").read_text(encoding="utf-8")
    assert "torch==2.13.0" in text
    assert "-m venv" in text
    assert "[dev,bench,gpu]" in text  # (gpu: Triton, whose kernels the tests interpret)


def test_ci_runs_the_readme_test_command() -> None:
    text = (ROOT / ".ci/run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in text
    for check in ("ruff check chainfuse tests", "ruff format --check", "mypy --strict chainfuse"):
        assert check in text
