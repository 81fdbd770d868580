"""Whether a 16-bit call is better left to PyTorch: dispatch that never makes a model slower.

chainfuse computes a bf16 or fp16 chain on a matrix engine where one of its kernels runs it
(AMX, `kernels.amx.amx_path`), else widened to fp32 on the FMA units (`fp32-fma`). PyTorch's
own 16-bit ops may be faster than the latter where the machine has a 16-bit unit (AMX or
AVX512-BF16 that oneDNN uses while chainfuse's AMX kernels are off or the permission is refused).
The model decides, with both sides costed the same way (docs/tuning.md#torch_half_rate):

- chainfuse: the fused plan of the chain on `Hardware.fp32_units()`;
- PyTorch: the unfused chain (each GEMM on its own, the intermediate through memory in the
  chain's dtype) at PyTorch's 16-bit GEMM rate (`torch_rate`).

The torch entry points (`chainfuse.torch`) hand a call to PyTorch where PyTorch is predicted
faster, and count it as a fallback. numpy callers have nothing to hand to: they keep chainfuse's
kernel, whose `Kernel.arithmetic` says `fp32-fma`.
"""

from __future__ import annotations

import dataclasses
import functools

from chainfuse.codegen.amx_chain import amx_unsupported
from chainfuse.codegen.gemm_spec import match_gemm_chain
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain, DType
from chainfuse.kernels.amx import amx_path
from chainfuse.planner import plan

__all__ = ["TORCH_HALF_RATE", "host", "torch_faster", "torch_rate"]

#: PyTorch's 16-bit GEMM rate as a share of the fp32 peak on a CPU that lists no 16-bit peak (no
#: AMX, no AVX512-BF16): it widens bf16 and fp16 as chainfuse does, at about the fp32 rate or
#: lower (docs/tuning.md#torch_half_rate)
TORCH_HALF_RATE = 1.0

_HALF = (DType.BFLOAT16, DType.FLOAT16)


def host() -> Hardware:
    """The machine calls run on (tests replace it to force the model's answer)."""
    return Hardware.detect()


def torch_rate(hw: Hardware, dtype: DType) -> float:
    """Per-core FLOP/s PyTorch's `dtype` GEMMs are modeled at on `hw`: the machine's own peak for
    `dtype` where it lists one (AMX, AVX512-BF16, a preset's figure), else `TORCH_HALF_RATE` of
    the fp32 peak."""
    peaks = dict(hw.peak_flops)
    return peaks.get(dtype, TORCH_HALF_RATE * hw.peak(DType.FLOAT32))


def torch_faster(chain: Chain, threads: int, hw: Hardware | None = None) -> bool:
    """Whether PyTorch's unfused ops are predicted faster than chainfuse's kernel for `chain`
    (16-bit) on `threads` threads of `hw` (default: `host()`). False where an AMX kernel runs
    the chain, and for fp32 chains."""
    if chain.dtype not in _HALF:
        return False
    if amx_path(chain.dtype) is not None:
        first, second = chain.contractions
        k, n = first.reduction[0], second.output.loops[-1]
        if not amx_unsupported(match_gemm_chain(chain), (chain.extents[k], chain.extents[n])):
            return False
    return _torch_faster(chain, threads, host() if hw is None else hw)


@functools.lru_cache(maxsize=512)
def _torch_faster(chain: Chain, threads: int, hw: Hardware) -> bool:
    fma = hw.fp32_units()
    rate = torch_rate(hw, chain.dtype)
    if rate <= fma.peak(chain.dtype):
        # the model is monotone in the rate: PyTorch's unfused chain at no more than the fp32
        # rate costs at least chainfuse's own unfused plan, which its chosen plan never loses to
        return False
    ours = plan(chain, fma, threads=threads).predicted_time_s
    # the unfused chain on a machine whose rate for this dtype is PyTorch's: fp32_units drops
    # the 16-bit peaks (the planner would use them for an engine's kernels), so the rate is
    # given as the float32 peak, which a 16-bit chain without an engine is planned at
    peaks = tuple((d, rate if d is DType.FLOAT32 else f) for d, f in fma.peak_flops)
    theirs = plan(chain, dataclasses.replace(fma, peak_flops=peaks), threads=threads, fuse=False)
    return theirs.predicted_time_s < ours
