"""Micro-kernels: one register block of a GEMM, one module per ISA, ranked by `select`.

Importing this package registers every kernel below, in this order (which breaks score ties).
Adding an ISA (NEON, AMX, ...) is one new module with a `microkernel`-decorated emitter, imported
here, plus one test parametrisation.
"""

from chainfuse.kernels import avx2, avx512, portable, scalar
from chainfuse.kernels.avx2 import avx2_fma_6x16_f32
from chainfuse.kernels.avx512 import avx512_6x64_f32, avx512_12x32_f32
from chainfuse.kernels.contract import MicroKernel, Problem, Score, scores_exp_parts
from chainfuse.kernels.packing import emit_with_packing, pack_a, pack_b
from chainfuse.kernels.portable import portable_4x16_f32
from chainfuse.kernels.registry import (
    REGISTRY,
    Registry,
    available,
    microkernel,
    register,
    select,
    select_weighted,
)
from chainfuse.kernels.scalar import reference_4x4_f32
from chainfuse.kernels.vector import PREFETCH_FAR, VectorOps, emit_vector_tile

__all__ = [
    "PREFETCH_FAR",
    "REGISTRY",
    "MicroKernel",
    "Problem",
    "Registry",
    "Score",
    "VectorOps",
    "available",
    "avx2",
    "avx2_fma_6x16_f32",
    "avx512",
    "avx512_6x64_f32",
    "avx512_12x32_f32",
    "emit_vector_tile",
    "emit_with_packing",
    "microkernel",
    "pack_a",
    "pack_b",
    "portable",
    "portable_4x16_f32",
    "reference_4x4_f32",
    "register",
    "scalar",
    "scores_exp_parts",
    "select",
    "select_weighted",
]
