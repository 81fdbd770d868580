"""chainfuse: fuse chains of compute-intensive tensor operators into one kernel, planned by a model.

chain = chainfuse.gemm_chain(12, 512, 64, 64, 512, between="softmax")
plan = chainfuse.plan(chain)                 # the model's schedule, printable as a table
chainfuse.simulate(chain, plan)              # what that schedule really moves, per level
kernel = chainfuse.compile(chain)            # one fused C kernel for this CPU
E = kernel(A, B, D)
"""

from chainfuse import ops
from chainfuse.builders import (
    attention_chain,
    conv_chain_spec,
    from_einsum,
    gated_mlp_chain,
    gemm_chain,
    mlp_chain,
)
from chainfuse.compiler import Kernel, compile
from chainfuse.config import VERSION as __version__
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain
from chainfuse.planner import Plan, PlanningError, plan
from chainfuse.runtime import get_num_threads, set_num_threads
from chainfuse.simulate import simulate

__all__ = [
    "Chain",
    "Hardware",
    "Kernel",
    "Plan",
    "PlanningError",
    "__version__",
    "attention_chain",
    "compile",
    "conv_chain_spec",
    "from_einsum",
    "gated_mlp_chain",
    "gemm_chain",
    "get_num_threads",
    "mlp_chain",
    "ops",
    "plan",
    "set_num_threads",
    "simulate",
]
