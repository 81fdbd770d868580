"""The micro-kernels chainfuse knows (`REGISTRY`), the `microkernel` decorator that registers
one, and `select`, which ranks the applicable ones by `MicroKernel.score`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import DType
from chainfuse.kernels.contract import MicroKernel, Problem

__all__ = [
    "REGISTRY",
    "Registry",
    "available",
    "microkernel",
    "register",
    "select",
    "select_weighted",
]


class Registry:
    """Micro-kernels by name, in registration order. `REGISTRY` is the one chainfuse uses."""

    def __init__(self) -> None:
        self._kernels: dict[str, MicroKernel] = {}

    def register(self, kernel: MicroKernel) -> MicroKernel:
        """Add ``kernel``; a second kernel with the same name is a `ValueError`."""
        if not isinstance(kernel, MicroKernel):
            raise TypeError(f"can only register a MicroKernel, got {type(kernel).__name__}")
        if kernel.name in self._kernels:
            raise ValueError(f"micro-kernel {kernel.name!r} is already registered")
        self._kernels[kernel.name] = kernel
        return kernel

    def available(self) -> tuple[MicroKernel, ...]:
        return tuple(self._kernels.values())

    def select(self, problem: Problem, hardware: Hardware) -> MicroKernel:
        """The applicable kernel with the highest `MicroKernel.score`."""
        candidates = [k for k in self._kernels.values() if k.applies(problem, hardware)]
        if not candidates:
            known = ", ".join(
                f"{k.name} ({'/'.join(d.value for d in k.dtypes)})" for k in self._kernels.values()
            )
            raise ValueError(
                f"no micro-kernel handles {problem.dtype.value} on {hardware.name!r}; "
                f"registered: {known or 'none'}"
            )
        return max(candidates, key=lambda k: k.score(problem, hardware))

    def select_weighted(
        self, problems: Sequence[tuple[Problem, float]], hardware: Hardware
    ) -> MicroKernel:
        """One kernel for several GEMMs that run with it (a chain's two contractions), each
        weighted by its flops: the highest time-weighted peak fraction, ``sum(w) / sum(w /
        fraction)``, then the first problem's other criteria."""
        if not problems:
            raise ValueError("select_weighted: no problems given")
        first = problems[0][0]
        candidates = [k for k in self._kernels.values() if k.applies(first, hardware)]
        if not candidates:
            return self.select(first, hardware)  # the error that names what is registered
        total = sum(w for _, w in problems)

        def key(k: MicroKernel) -> tuple[float, ...]:
            scores = [(k.score(p, hardware), w) for p, w in problems]
            time = sum(w / sc[0] for sc, w in scores if sc[0] > 0)
            fraction = total / time if time > 0 else 0.0
            return (round(fraction, 9), *scores[0][0][1:])

        return max(candidates, key=key)


REGISTRY = Registry()


def register(kernel: MicroKernel) -> MicroKernel:
    """Add ``kernel`` to `REGISTRY` (duplicate names are a `ValueError`) and return it."""
    return REGISTRY.register(kernel)


def available() -> tuple[MicroKernel, ...]:
    """Every registered micro-kernel, applicable here or not, in registration order."""
    return REGISTRY.available()


def select(problem: Problem, hardware: Hardware) -> MicroKernel:
    """The best applicable micro-kernel for ``problem`` on ``hardware`` (see `MicroKernel.score`)."""
    return REGISTRY.select(problem, hardware)


def select_weighted(problems: Sequence[tuple[Problem, float]], hardware: Hardware) -> MicroKernel:
    """The best applicable micro-kernel for several (problem, flops) run with one kernel."""
    return REGISTRY.select_weighted(problems, hardware)


def microkernel(
    *,
    name: str,
    isa: frozenset[Isa],
    dtypes: tuple[DType, ...],
    mr: int,
    nr: int,
    registers: int,
    flops_per_instruction: int,
    kr: int = 1,
    cflags: tuple[str, ...] = (),
    transpose: Callable[[MicroKernel], str] | None = None,
    transpose_block: int = 0,
    part_rows: int = 0,
    part_cols: int = 0,
    scores_exp: Callable[[MicroKernel], str] | None = None,
    wide: Callable[[MicroKernel], str] | None = None,
    wide_cols: tuple[int, ...] = (),
    wide_mr: int = 0,
    exp2_strip: Callable[[MicroKernel], str] | None = None,
    registry: Registry = REGISTRY,
) -> Callable[[Callable[[MicroKernel], str]], MicroKernel]:
    """Decorator: turn a full-tile emitter into a registered `MicroKernel`.

    ::

        @microkernel(name="avx2_fma_6x16_f32", isa=frozenset({Isa.AVX2, Isa.FMA}), ...)
        def avx2_fma_6x16_f32(kernel: MicroKernel) -> str:
            return emit_vector_tile(kernel, AVX2)
    """

    def wrap(full_tile: Callable[[MicroKernel], str]) -> MicroKernel:
        kernel = MicroKernel(
            name=name,
            isa=isa,
            dtypes=dtypes,
            mr=mr,
            nr=nr,
            kr=kr,
            registers=registers,
            flops_per_instruction=flops_per_instruction,
            full_tile=full_tile,
            cflags=cflags,
            transpose=transpose,
            transpose_block=transpose_block,
            part_rows=part_rows,
            part_cols=part_cols,
            scores_exp=scores_exp,
            wide=wide,
            wide_cols=wide_cols,
            wide_mr=wide_mr,
            exp2_strip=exp2_strip,
        )
        return registry.register(kernel)

    return wrap
