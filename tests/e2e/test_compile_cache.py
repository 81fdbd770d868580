"""A kernel compiled by one process is reused by the next: same source, same cache entry.

Regression: the kernel's name once hashed a set's repr, whose order changes with the hash seed
of each process, so every new process compiled the same kernel again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = """
import chainfuse
kernel = chainfuse.compile(chainfuse.attention_chain(1, 2, 33, 47, 16, 8, causal=True))
print(kernel.cached, kernel.path)
"""


def test_second_process_reuses_the_compiled_kernel(tmp_path: Path) -> None:
    env = {**os.environ, "CHAINFUSE_CACHE_DIR": str(tmp_path)}
    runs = []
    for seed in ("1", "2"):  # different hash seeds, as two unrelated processes would have
        done = subprocess.run([sys.executable, "-c", CODE], env={**env, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True)  # fmt: skip
        runs.append(done.stdout.split())
    (cold, first_path), (warm, second_path) = runs
    assert cold == "False" and warm == "True"
    assert first_path == second_path
