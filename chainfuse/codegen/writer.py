"""The one indenting writer every code generator uses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Writer"]


class Writer:
    """Collects lines at the current indent; `block()` opens `{ ... }` one level deeper."""

    def __init__(self, indent: str = "    ") -> None:
        self._lines: list[str] = []
        self._depth = 0
        self._indent = indent

    def line(self, text: str = "") -> None:
        self._lines.append(self._indent * self._depth + text if text else "")

    def lines(self, text: str) -> None:
        """Several lines (a dedented snippet) at the current indent."""
        for part in text.strip("\n").split("\n"):
            self.line(part)

    @contextmanager
    def block(self, head: str, tail: str = "}") -> Iterator[None]:
        self.line(f"{head} {{")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self.line(tail)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
