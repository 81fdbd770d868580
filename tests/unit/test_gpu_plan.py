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


def test_detect_a_cuda_device_from_its_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the driver reports replaces the preset's figures; peaks scale with the SM count."""
    from chainfuse import hardware

    props = {
        "name": "NVIDIA H100 PCIe", "sms": 114, "total_memory": 80 * 1000**3, "l2": 50 * 2**20,
        "compute_capability": (9, 0), "smem_per_sm": 233472, "smem_per_program": 232448,
        "registers_per_sm": 65536, "threads_per_sm": 2048,
    }  # fmt: skip
    monkeypatch.setattr(hardware, "gpu_properties", lambda index: props if index == 0 else None)
    hardware._detect_gpu.cache_clear()
    try:
        hw = Hardware.detect("cuda")
        h100 = Hardware.preset("h100")
        assert hw.cores == 114 and hw.name == "cuda: NVIDIA H100 PCIe"
        assert hw.levels[0].capacity == 233472 and hw.levels[-1].capacity == 80 * 1000**3
        assert hw.gpu is not None and h100.gpu is not None
        assert hw.gpu.tensor_peak("float16") == pytest.approx(
            h100.gpu.tensor_peak("float16") * 114 / 132  # type: ignore[operator]
        )
        assert hw.peak("float16") == h100.peak("float16")  # per SM: the same
        assert plan_triton(builders.gemm_chain(2, 65, 64, 64, 129, "softmax"), "cuda").grid
        props.update(name="NVIDIA L4", compute_capability=(8, 9), sms=58, smem_per_program=101376)
        hardware._detect_gpu.cache_clear()
        l4 = Hardware.detect("cuda:0")
        assert l4.name == "cuda: NVIDIA L4 (clocks and peaks of a100)" and l4.cores == 58
        assert l4.gpu is not None and l4.gpu.smem_per_program == 101376
        with pytest.raises(RuntimeError, match="no CUDA device 1"):
            Hardware.detect("cuda:1")
        with pytest.raises(ValueError, match="device: expected"):
            Hardware.detect("gpu")
    finally:
        hardware._detect_gpu.cache_clear()


def test_cli_prints_the_triton_launch(capsys: pytest.CaptureFixture[str]) -> None:
    from chainfuse.cli import main

    assert main(["plan", "bert-base", "--hw", "h100", "--simulate"]) == 0
    text = capsys.readouterr().out
    assert "BLOCK_M=" in text and "num_warps=" in text and "triton: grid" in text


def test_bench_refuses_without_a_cuda_device(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from chainfuse.bench.runner import main

    assert main(["--device", "cuda", "--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
