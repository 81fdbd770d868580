"""GPU plans: the model's block loop nest as a Triton launch grid, block sizes, warps and stages.

A Triton program owns registers, shared-memory staging and the tensor-core instructions; what is
left to decide is what chainfuse's model decides on a CPU: which loops run across programs (the
launch grid), which inside one, the block size of every loop, and what stays on chip. For a two-op
chain `E = f(A·B)·D` (GEMM chains, MLPs, attention) the one structure is

    grid:  batch loops x ⌈M / BLOCK_M⌉ x ⌈N / BLOCK_N⌉          (order b.. > m > n, the prefix)
    in a program:  for l by BLOCK_L:                           (the intermediate's loop)
                       C = Σ_k A[m, k] · B[k, l]  by BLOCK_K     (registers)
                       E_acc += f(C) · D[l, n]                   (registers, online softmax)
                   E[m, n] = E_acc                               (written once)

i.e. the model's order `b.. > m > n > l > k` with the prefix `b.. > m > n > l`: the intermediate
never leaves the program, and where it does not fit one program (an MLP's wide hidden dim) the
program loops over `l` with the output accumulated in registers. A split `n` recomputes `C` per
block of `n`; the model counts that recompute, so it chooses between a wide accumulator and a
split by predicted time. Levels: the program's blocks are the tiles of shared memory (what one
program stages); L2's tiles are one batch entry's whole problem where its working set fits
`USABLE` of L2 (the grid is launched batch-major, so one entry's programs run together and share
it), else the blocks again (no reuse across programs assumed). The simulator counts the same
bytes for these tiles.

Launch rule (documented in docs/design.md, no autotuning):

- blocks are powers of two ≥ 16 (`tl.dot`'s smallest); `BLOCK_N` is N rounded up to a power of
  two where N ≤ `WHOLE_N` (one program row holds all of E's columns), else 64..256; `BLOCK_K`
  is K rounded up where K ≤ `WHOLE_K`, else 32..128;
- `num_warps`: the fp32 accumulators `BLOCK_M · (BLOCK_N + BLOCK_L)` spread over the warps' threads
  at most `ACC_REGISTERS` each: the least power of two of warps that holds them, at least
  `MIN_WARPS`, at most `MAX_WARPS`; blocks needing more are not candidates;
- `num_stages`: how many copies of one stage's operand tiles (A, B and D blocks) fit in
  `USABLE` of the program's shared memory, clipped to 1..`MAX_STAGES`; blocks of which not even
  one copy fits are not candidates.

Every candidate is costed by `model.estimate` on the GPU's `Hardware` (SMs as cores, the grid's
programs dealt to them) and the fastest kept; ties go to the larger blocks.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from chainfuse.hardware import DeviceKind, Hardware, resolve
from chainfuse.ir import Chain, Contraction, Softmax
from chainfuse.model import Nest, estimate, level_cost
from chainfuse.planner import USABLE, Plan, PlanningError

__all__ = [
    "ACC_REGISTERS",
    "MAX_STAGES",
    "MAX_WARPS",
    "MIN_WARPS",
    "WHOLE_K",
    "WHOLE_N",
    "TritonPlan",
    "launch_rule",
    "plan_triton",
]

BLOCKS = (16, 32, 64, 128)
WHOLE_N = 256  # up to this many output columns, one program holds them all
WHOLE_K = 128  # up to this reduction, one block of k (A's block loaded once per program row)
WIDE_N = (64, 128, 256)
WIDE_K = (32, 64, 128)
ACC_REGISTERS = 128  # fp32 accumulator registers per thread (of 255: addresses, operands too)
MIN_WARPS = 4
MAX_WARPS = 8
MAX_STAGES = 4


@dataclass(frozen=True)
class TritonPlan:
    """A Triton kernel's launch for one chain: the model's plan (its tiles are the blocks) plus
    the block sizes, the grid's loops and the warps and stages of one program."""

    plan: Plan
    block_m: int
    block_n: int
    block_k: int
    block_l: int
    num_warps: int
    num_stages: int
    grid: tuple[str, ...]  # loops launched as programs, outermost first

    @property
    def blocks(self) -> dict[str, int]:
        return {"m": self.block_m, "n": self.block_n, "k": self.block_k, "l": self.block_l}

    def programs(self, extents: dict[str, int]) -> int:
        """How many programs the grid launches for a chain of these extents."""
        blocks = self.blocks
        return math.prod(-(-extents[n] // blocks.get(n, 1)) for n in self.grid)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "plan": json.loads(self.plan.to_json()),
            **self.blocks,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "grid": list(self.grid),
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TritonPlan:
        d = json.loads(text)
        return cls(
            Plan.from_json(json.dumps(d["plan"])), int(d["m"]), int(d["n"]), int(d["k"]),
            int(d["l"]), int(d["num_warps"]), int(d["num_stages"]), tuple(d["grid"]),
        )  # fmt: skip

    def __str__(self) -> str:
        grid = " x ".join(
            n if n not in self.blocks else f"⌈{n}/{self.blocks[n]}⌉" for n in self.grid
        )
        return "\n".join(
            [
                str(self.plan),
                f"  triton: grid {grid}; in a program l by BLOCK_L={self.block_l}, k by "
                f"BLOCK_K={self.block_k}",
                f"  blocks BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
                f"BLOCK_L={self.block_l}; num_warps={self.num_warps} "
                f"num_stages={self.num_stages}",
            ]
        )


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_rule(
    blocks: dict[str, int], itemsize: int, hardware: Hardware
) -> tuple[int, int] | None:
    """(num_warps, num_stages) of a program with these blocks, or None if it does not fit
    (the rule in the module docstring)."""
    gpu = hardware.gpu
    if gpu is None:
        raise ValueError(f"hardware {hardware.name!r} is not a GPU (no `gpu` figures)")
    bm, bn, bk, bl = blocks["m"], blocks["n"], blocks["k"], blocks["l"]
    acc = bm * (bn + bl)
    warps = MIN_WARPS
    while warps * gpu.warp_size * ACC_REGISTERS < acc:
        warps *= 2
    if warps > MAX_WARPS or warps * gpu.warp_size > gpu.threads_per_sm:
        return None
    stage = (bm * bk + bk * bl + bl * bn) * itemsize
    stages = int(gpu.smem_per_program * USABLE // stage)
    if stages < 1:
        return None
    return warps, min(stages, MAX_STAGES)


def _structure(chain: Chain) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch loops, order) of the one GPU structure; an error for chains it does not cover."""
    ops = chain.ops
    contractions = [op for op in ops if isinstance(op, Contraction)]
    names = set(chain.extents)
    if len(contractions) != 2 or not {"m", "n", "k", "l"} <= names:
        raise PlanningError(
            f"{chain.name}: the GPU target plans two-GEMM chains (GEMM chains, MLPs, attention), "
            "not this chain"
        )
    if any(not isinstance(op, Contraction | Softmax) and not hasattr(op, "fn") for op in ops):
        raise PlanningError(f"{chain.name}: an op between the GEMMs the GPU target cannot run")
    batch = tuple(n for n in chain.extents if n not in ("m", "n", "k", "l"))
    return batch, (*batch, "m", "n", "l", "k")


def plan_triton(chain: Chain, hardware: Hardware | str | None = "h100") -> TritonPlan:
    """The Triton launch of `chain` on a GPU (`hardware`: a GPU `Hardware`, a GPU preset, or
    "cuda" for the device present), chosen by the model as the module docstring says."""
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    hw = resolve(hardware)
    if hw.kind is not DeviceKind.GPU or hw.gpu is None:
        raise ValueError(f"hardware: {hw.name!r} is not a GPU; use a100, h100, h200 or cuda")
    batch, order = _structure(chain)
    ext = chain.extents
    nest = Nest(chain, order, len(batch) + 3)
    grid = (*batch, "m", "n")
    itemsize = chain.dtype.itemsize
    levels = [lv.name for lv in hw.levels[:-1]]

    def up_to(extent: int, sizes: tuple[int, ...]) -> list[int]:
        fit = [b for b in sizes if b <= max(16, _pow2(extent))]
        return fit or [sizes[0]]

    n_sizes = [_pow2(max(16, ext["n"]))] if ext["n"] <= WHOLE_N else list(WIDE_N)
    k_sizes = [_pow2(max(16, ext["k"]))] if ext["k"] <= WHOLE_K else list(WIDE_K)
    # a shared cache (L2) that holds one batch entry's whole working set reads it from memory
    # once: the programs of one batch entry run together (the grid is batch-major)
    whole = {n: (1 if n in batch else ext[n]) for n in order}
    used = level_cost(nest, whole).used
    shared = {lv.name for lv in hw.levels[1:-1] if lv.shared and used <= USABLE * lv.capacity}
    best: tuple[tuple[float, int], dict[str, int], tuple[int, int], Any] | None = None
    for bm, bl, bn, bk in itertools.product(
        up_to(ext["m"], BLOCKS), up_to(ext["l"], BLOCKS), n_sizes, k_sizes
    ):
        blocks = {"m": bm, "n": bn, "k": bk, "l": bl}
        launch = launch_rule(blocks, itemsize, hw)
        if launch is None:
            continue
        tiles = {n: (min(blocks[n], ext[n]) if n in blocks else 1) for n in order}
        per_level = {levels[0]: tiles, **{lvl: (whole if lvl in shared else tiles)
                                          for lvl in levels[1:]}}  # fmt: skip
        cost = estimate(nest, per_level, hw, grid, hw.cores)
        key = (cost.time_s, -(bm * bl * bn))
        if best is None or key < best[0]:
            best = (key, blocks, launch, (cost, per_level))
    if best is None:
        raise PlanningError(f"no Triton blocks of {chain.name} fit {hw.name}'s programs")
    _, blocks, (warps, stages), (cost, per_level) = best
    plan = Plan(
        chain=chain.name,
        hardware=hw.name,
        fused=True,
        order=order,
        depth=len(batch) + 3,
        tiles=tuple((lvl, tuple((n, t[n]) for n in order)) for lvl, t in per_level.items()),
        parallel=grid,
        threads=hw.cores,
        register_block=(16, 16),  # tl.dot's smallest block: the tensor cores' quantum
        bytes_per_level=cost.bytes_per_level,
        used_per_level=cost.used_per_level,
        flops=cost.flops,
        predicted_time_s=cost.time_s,
        compute_time_s=cost.compute_s,
        unfused_time_s=math.inf,
        bound=cost.bound,
        considered=1,
    )
    return TritonPlan(plan, blocks["m"], blocks["n"], blocks["k"], blocks["l"], warps, stages, grid)
