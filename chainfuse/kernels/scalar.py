"""The scalar reference micro-kernel: plain C loops, every machine, the fallback of `select`.

It needs no ISA flag, so it applies on any hardware; it is also the readable statement of what
every other micro-kernel computes. A 4x4 block keeps its 16 accumulators in scalar registers.
"""

from __future__ import annotations

from chainfuse.ir import DType
from chainfuse.kernels.contract import MicroKernel
from chainfuse.kernels.registry import microkernel

__all__ = ["reference_4x4_f32"]


@microkernel(
    name="reference_4x4_f32",
    isa=frozenset(),
    dtypes=(DType.FLOAT32,),
    mr=4,
    nr=4,
    registers=16,
    flops_per_instruction=1,
)
def reference_4x4_f32(kernel: MicroKernel) -> str:
    mr, nr, name = kernel.mr, kernel.nr, kernel.name
    return f"""
/* {name}_full_s: C[0:{mr}, 0:{nr}] (+)= A . Bp with A(i, p) = A[i*rs + p*ks], one
   multiply-add at a time. */
static inline void {name}_full_s(int kc, const float* restrict A, long rs, long ks,
                                 const float* restrict Bp, float* restrict C, long ldc,
                                 int accumulate)
{{
    float acc[{mr}][{nr}];
    for (int i = 0; i < {mr}; ++i) {{
        for (int j = 0; j < {nr}; ++j) acc[i][j] = 0.0f;
    }}
    for (int p = 0; p < kc; ++p) {{
        for (int i = 0; i < {mr}; ++i) {{
            const float a = A[i * rs + p * ks];
            for (int j = 0; j < {nr}; ++j) acc[i][j] += a * Bp[(long)p * {nr} + j];
        }}
    }}
    for (int i = 0; i < {mr}; ++i) {{
        for (int j = 0; j < {nr}; ++j) {{
            const float r = accumulate & 1 ? C[i * ldc + j] + acc[i][j] : acc[i][j];
            C[i * ldc + j] = accumulate & RELU_AT_STORE ? (r < 0.0f ? 0.0f : r) : r;
        }}
    }}
}}

/* {name}_full_g: the same over ng groups of kc steps, group g's A at A + g*gs and its steps at
   Bp + g*kc*{nr}: one run into C, then the others added. */
static inline void {name}_full_g(int kc, int ng, long gs, const float* restrict A, long rs,
                                 long ks, const float* restrict Bp, float* restrict C, long ldc,
                                 int accumulate)
{{
    for (int g = 0; g < ng; ++g) {{
        const int relu = g == ng - 1 ? accumulate & RELU_AT_STORE : 0; /* the last run's */
        {name}_full_s(kc, A + g * gs, rs, ks, Bp + (long)g * kc * {nr}, C, ldc,
                      (accumulate & 1) | (g > 0) | relu);
    }}
}}
"""
