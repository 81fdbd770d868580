"""Plans remembered on disk next to the compiled kernels, so a warm process does not plan again.

Planning costs tens of milliseconds; a process that reuses a compiled kernel should not pay it
again. A plan's key holds everything it depends on, the planner's own source files included.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import warnings
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
        data = path.read_bytes()
    except OSError:
        data = None  # (none yet)
    if data is not None:
        try:
            remembered = Plan.from_json(data.decode())
            problem = _unsound(remembered, chain, hw, threads or hw.cores)
        except (
            ValueError,
            LookupError,
            TypeError,
            AttributeError,
            ArithmeticError,
            RecursionError,
        ) as err:
            problem = f"unreadable ({type(err).__name__}: {err})"
        if problem is None:
            return remembered
        warnings.warn(
            f"chainfuse: ignoring the remembered plan {path}: {problem}; planning again",
            RuntimeWarning,
            stacklevel=3,
        )
    chosen = plan(chain, hw, threads=threads, fuse=True, structures=[structure], quanta=quanta,
                  split=split)  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, chosen.to_json().encode())
    except OSError:
        pass
    return chosen


def _unsound(p: Plan, chain: Chain, hw: Hardware, threads: int) -> str | None:
    """What makes a plan read from disk unfit for `chain` on `hw` (a damaged or foreign file),
    or None: its tiles become loop bounds and workspace sizes, so a tile out of 1..extent would
    divide by zero, never end or allocate without bound."""
    ext = chain.extents
    if p.chain != chain.name or p.hardware != hw.name:
        return f"it is for {p.chain!r} on {p.hardware!r}"
    if sorted(p.order) != sorted(ext) or not 0 <= p.depth <= len(p.order):
        return f"its loop order {p.order} (depth {p.depth}) is not of the loops {sorted(ext)}"
    levels = {lv.name for lv in hw.levels}
    for level, tiles in p.tiles:
        if level not in levels:
            return f"it has tiles for an unknown level {level!r}"
        for loop, t in tiles:
            if not 1 <= t <= ext[loop]:
                return f"its tile {t} of {loop!r} at {level} is not within 1..{ext[loop]}"
    if p.split is not None and (p.split[0] not in ext or not 1 <= p.split[1] <= ext[p.split[0]]):
        return f"its split {p.split} is not of a loop"
    if not set(p.parallel) <= set(ext) or p.threads != threads:
        return f"its parallel loops {p.parallel} or threads {p.threads} do not fit"
    if min(p.register_block) < 1 or not all(
        math.isfinite(x) and x >= 0
        for x in (p.predicted_time_s, p.compute_time_s, p.unfused_time_s)
    ):
        return "its register block or predicted times are out of range"
    return None


@functools.cache
def planner_fingerprint() -> str:
    """chainfuse's version and the files of the modules a plan comes from (`files_fingerprint`):
    a changed model must not be answered with plans remembered from the old one (the version
    alone does not move between releases)."""
    return files_fingerprint(Path(str(m.__file__)) for m in (footprint, model, planner))[:16]
