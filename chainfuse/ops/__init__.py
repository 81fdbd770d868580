"""Functional ops: numpy arrays or torch CPU tensors in, the same kind out.

Each op builds the chain for its arguments' shapes, compiles it on first use, and keeps the
compiled kernel for later calls with the same shapes (`calls`, the one cache of every op).
Sizes and tiles are run-time arguments of the generated code, so every shape of one chain
structure shares one compiled object on disk per micro-kernel (the rows choose it): a new
sequence length costs a plan and a load, not a compile, once `rows_vary()` has built the other
row counts' kernels, and attention's key lengths share a plan per bucket.

    E = chainfuse.ops.gemm_chain(A, B, D, between="relu")   # relu(A @ B) @ D, batched
    y = chainfuse.ops.gated_mlp(x, w1.T, w3.T, w2.T)           # SwiGLU, nn.Linear weights
    P = chainfuse.ops.pack_weights(w1.T, w2.T)                 # bf16 weights, once (AMX)
    y = chainfuse.ops.conv_chain(x, w1, w2, stride=(2, 1), padding=(1, 0), between="relu")
"""

from chainfuse.ops.attention import attention
from chainfuse.ops.calls import calls, rows_vary
from chainfuse.ops.conv_chain import PackedConvWeights, conv_chain, pack_conv_weights
from chainfuse.ops.gated_mlp import gated_mlp, gated_mlp_shape
from chainfuse.ops.gemm_chain import gemm_chain, gemm_chain_shape
from chainfuse.ops.packed import pack_weights
from chainfuse.ops.sdpa import attention_dims, attention_shape

__all__ = [
    "PackedConvWeights",
    "attention",
    "attention_dims",
    "attention_shape",
    "calls",
    "conv_chain",
    "gated_mlp",
    "gated_mlp_shape",
    "gemm_chain",
    "gemm_chain_shape",
    "pack_conv_weights",
    "pack_weights",
    "rows_vary",
]
