"""A portable SIMD micro-kernel in GCC/clang vector extensions (``vector_size(32)``).

No intrinsics and no ISA flag: the compiler maps 8-float vectors onto whatever the target has
(one AVX register, two SSE or NEON registers) and, with ``-ffp-contract=fast``, fuses ``a*b + c``
into FMAs where they exist. It is what `select` picks on a machine it knows nothing about. The 4x16
block keeps 8 accumulators (16 halves on a 128-bit ISA, still within 16 SSE / 32 NEON registers
with the B vectors), so it does not spill where the vectors are narrower than declared.
"""

from __future__ import annotations

from chainfuse.ir import DType
from chainfuse.kernels.contract import MicroKernel
from chainfuse.kernels.registry import microkernel
from chainfuse.kernels.vector import VectorOps, emit_vector_tile

__all__ = ["VECTOR_EXTENSIONS", "portable_4x16_f32"]

VECTOR_EXTENSIONS = VectorOps(
    type="chainfuse_v8sf",
    lanes=8,
    preamble="""\
#ifndef CHAINFUSE_V8SF_DEFINED
#define CHAINFUSE_V8SF_DEFINED
typedef float chainfuse_v8sf __attribute__((vector_size(32)));
/* memcpy: the panels and C need not be 32-byte aligned; compilers emit one unaligned load. */
static inline chainfuse_v8sf chainfuse_v8sf_load(const float* p)
{
    chainfuse_v8sf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline void chainfuse_v8sf_store(float* p, chainfuse_v8sf v)
{
    __builtin_memcpy(p, &v, sizeof v);
}
static inline chainfuse_v8sf chainfuse_v8sf_splat(float x)
{
    return (chainfuse_v8sf){x, x, x, x, x, x, x, x};
}
static inline chainfuse_v8sf chainfuse_v8sf_relu(chainfuse_v8sf v)
{
    for (int i = 0; i < 8; ++i) v[i] = v[i] < 0.0f ? 0.0f : v[i]; /* NaN stays NaN */
    return v;
}
#endif
""",
    zero="chainfuse_v8sf_splat(0.0f)",
    load="chainfuse_v8sf_load({ptr})",
    store="chainfuse_v8sf_store({ptr}, {v})",
    broadcast="chainfuse_v8sf_splat(*({ptr}))",
    fma="{a} * {b} + {c}",
    add="{a} + {b}",
    relu="chainfuse_v8sf_relu({v})",
)


@microkernel(
    name="portable_4x16_f32",
    isa=frozenset(),
    dtypes=(DType.FLOAT32,),
    mr=4,
    nr=16,
    registers=4 * 2 + 2 + 1,
    flops_per_instruction=8,
    part_rows=2,
)
def portable_4x16_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, VECTOR_EXTENSIONS)
