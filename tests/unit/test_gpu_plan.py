"""GPU plans: the model's bytes equal the simulator's on them; blocks and launches are legal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainfuse import builders
from chainfuse.bench import workloads
from chainfuse.gpu_plan import launch_rule, plan_triton
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain
from chainfuse.model import Nest, level_cost
from chainfuse.simulate import simulate, simulate_level

SIZES = st.sampled_from([1, 7, 17, 63, 65, 129, 131, 300])


def _check(chain: Chain, hw: str) -> None:
    tp = plan_triton(chain, hw)
    plan, hardware = tp.plan, Hardware.preset(hw)
    for b in tp.blocks.values():
        assert b >= 16 and b & (b - 1) == 0, tp.blocks
    assert launch_rule(tp.blocks, chain.dtype.itemsize, hardware) == (tp.num_warps, tp.num_stages)
    nest = Nest(chain, plan.order, plan.depth)
    for _level, tiles in plan.tiles:
        cost = level_cost(nest, dict(tiles))
        assert cost.total == simulate_level(chain, plan.order, plan.depth, dict(tiles)).bytes
    if not getattr(chain.ops[1], "causal", False):
        # (a causal plan's bytes are scaled by the keys each row block reads; level_cost above)
        assert simulate(chain, plan, hardware) == plan.predicted_bytes


@pytest.mark.parametrize("hw", ["a100", "h100"])
@pytest.mark.parametrize("name", [w.name for w in workloads.GEMM])
def test_paper_workloads(name: str, hw: str) -> None:
    _check(workloads.chain_of(name, "softmax", "float16"), hw)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), M=SIZES, N=SIZES, K=SIZES, L=SIZES,
       between=st.sampled_from([None, "relu", "softmax"]),
       dtype=st.sampled_from(["float32", "float16"]))  # fmt: skip
def test_model_equals_simulator(
    b: int, M: int, N: int, K: int, L: int, between: str | None, dtype: str
) -> None:
    _check(builders.gemm_chain(b, M, N, K, L, between, dtype), "h100")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool"])
def test_attention(causal: bool, mask: str | None) -> None:
    _check(builders.attention_chain(2, 3, 17, 129, 40, 24, causal, mask), "a100")


def test_a_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="not a GPU"):
        plan_triton(builders.gemm_chain(1, 2, 3, 4, 5), "xeon-gold-6240")


def test_gpu_presets_describe_the_gpu() -> None:
    for name in ("a100", "h100", "h200"):
        hw = Hardware.preset(name)
        assert hw.gpu is not None and hw.gpu.tensor_peak("float16") is not None
        assert Hardware.from_json(hw.to_json()) == hw
    assert Hardware.preset("a100").gpu.tensor_peak("float8") is None  # type: ignore[union-attr]
    assert Hardware.preset("h100").gpu.tensor_peak("float8") == 1978.9e12  # type: ignore[union-attr]
