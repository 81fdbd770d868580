"""Plans remembered on disk next to the compiled kernels, so a warm process does not plan again.

Planning costs tens of milliseconds; a process that reuses a compiled kernel should not pay it
again. A plan's key holds everything it depends on, the planner's own source files included.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from chainfuse import config, footprint, model, planner
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain
from chainfuse.planner import Plan, plan
from chainfuse.runtime.cache import files_fingerprint
from chainfuse.runtime.files import write_atomic

__all__ = ["planner_fingerprint", "remembered_plan"]


def remembered_plan(
    chain: Chain,
    hw: Hardware,
    threads: int | None,
    structure: tuple[tuple[str, ...], int],
    quanta: Mapping[str, int],
    split: tuple[str, int] | None = None,
) -> Plan:
    """`plan(...)` for a backend's structure, read from the cache directory when an equal call
    planned it before, else planned and written there (an unwritable cache only costs planning
    again next time)."""
    parts = [chain.to_json(), hw.to_json(), threads, structure, sorted(quanta.items()), split]
    parts.append(planner_fingerprint())
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    path = config.cache_dir() / "plans" / key[:2] / f"{key[:32]}.json"
    try:
        return Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        pass
    chosen = plan(chain, hw, threads=threads, fuse=True, structures=[structure], quanta=quanta,
                  split=split)  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, chosen.to_json().encode())
    except OSError:
        pass
    return chosen


@functools.cache
def planner_fingerprint() -> str:
    """chainfuse's version and the files of the modules a plan comes from (`files_fingerprint`):
    a changed model must not be answered with plans remembered from the old one (the version
    alone does not move between releases)."""
    return files_fingerprint(Path(str(m.__file__)) for m in (footprint, model, planner))[:16]
