"""Pieces every C generator shares: the fixed C of `csrc/`, the header comment, `ALIGN16`, the
per-thread loop and the short hash that names a kernel after its spec."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

from chainfuse.codegen.writer import Writer
from chainfuse.ir import Chain, Role

__all__ = [
    "ALIGN16",
    "PROLOGUE_END",
    "c_source",
    "chain_lines",
    "define_lines",
    "header_comment",
    "name_hash",
    "per_thread",
]

#: Rounds a count of floats up to whole 64-byte lines (the workspace's regions).
ALIGN16 = "#define ALIGN16(x) (((x) + 15) & ~15L)"

#: The line that ends a `csrc/` file's standalone prologue: the includes and stand-in
#: definitions that let the file compile alone, which a generated source has already.
PROLOGUE_END = "/* ---- end of the standalone prologue ---- */"


@functools.cache
def c_source(name: str) -> str:
    """The C of `chainfuse/codegen/csrc/<name>` as a generated source includes it: the text
    after its standalone prologue (`PROLOGUE_END`), or all of it where it has none."""
    path = resources.files("chainfuse") / "codegen" / "csrc" / name
    text = path.read_text(encoding="utf-8")
    _, found, body = text.partition(PROLOGUE_END + "\n")
    return body if found else text


def header_comment(w: Writer, header: str) -> None:
    """The source's opening comment: `header` (the chain, the plan, the predicted bytes)."""
    w.line("/*")
    for text in header.strip().split("\n"):
        w.line(f" * {text}".rstrip())
    w.line(" */")


def define_lines(w: Writer, head: str, lines: list[str]) -> None:
    """`#define head` whose body is `lines` (statements), one per continued line."""
    w.line(f"#define {head} \\")
    for i, text in enumerate(lines):
        w.line(f"    {text}" + (" \\" if i < len(lines) - 1 else ""))


def chain_lines(chain: Chain) -> tuple[str, str]:
    """A header's `chain:` body (one op a line) and its tensors line (name and role)."""
    ops = "\n".join(f"  {op}" for op in chain.ops)
    roles = ", ".join(
        f"{t.name} ({t.role.value})" for t in chain.tensors if t.role is not Role.INTERMEDIATE
    )
    return ops, roles


@contextmanager
def per_thread(w: Writer) -> Iterator[None]:
    """`for (t < nthreads)` as an OpenMP loop of one iteration per thread: `t` names the
    thread's workspace without omp.h."""
    w.line("/* one iteration per thread, so its index names its workspace: no omp.h needed */")
    w.line("#pragma omp parallel for schedule(static, 1) num_threads(nthreads)")
    with w.block("for (int t = 0; t < nthreads; ++t)"):
        yield


def name_hash(key: str) -> str:
    """Eight hex digits of the sha256 of `key`: a kernel name's suffix, the same in every
    process (a key spelled without sets or addresses)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]
