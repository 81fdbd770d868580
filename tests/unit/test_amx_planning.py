"""The planner knows the matrix engine: AMX's peak and tile capacity on `Hardware`, the AMX block
as the register block of bf16 chains, and plans for bf16 on an AMX machine that differ from
fp32's because the engine leaves memory as the bound."""

from __future__ import annotations

import dataclasses

import pytest

from chainfuse import builders
from chainfuse.bench import workloads
from chainfuse.hardware import AMX_TILE_BYTES, AMX_TILES, Hardware, Isa
from chainfuse.ir import DType
from chainfuse.kernels.amx import AMX_BF16_32X32
from chainfuse.planner import plan, register_block

AMX_PRESET = "xeon-8480"


def test_amx_preset_has_the_engine_and_its_tiles() -> None:
    hw = Hardware.preset(AMX_PRESET)
    assert hw.amx and hw.matrix_engine(DType.BFLOAT16) and hw.matrix_engine("bf16")
    assert not hw.matrix_engine(DType.FLOAT16) and not hw.matrix_engine(DType.FLOAT32)
    assert hw.tile_capacity == AMX_TILES * AMX_TILE_BYTES == 8 * 1024
    # 1024 dense FLOP a cycle a core (TDPBF16PS), 16x the two FMA pipes' fp32
    assert hw.peak(DType.BFLOAT16) == 1024 * hw.clock_hz == 16 * hw.peak(DType.FLOAT32)
    assert "AMX tiles 8 x 1 KiB" in str(hw)


def test_the_amx_block_fills_the_tiles() -> None:
    uk = AMX_BF16_32X32
    accumulators = uk.mr * uk.nr * 4  # fp32
    a_and_b = 2 * (16 * 64) + 2 * (16 * 64)  # two row tiles of A, two VNNI tiles of B
    assert accumulators + a_and_b == Hardware.preset(AMX_PRESET).tile_capacity


def test_machines_without_amx_plan_16_bit_at_the_fp32_rate() -> None:
    amx = Hardware.preset(AMX_PRESET)
    assert amx.for_chain(DType.BFLOAT16) is amx and amx.for_chain(DType.FLOAT32) is amx
    fma = amx.fp32_units()
    assert not fma.amx and fma.tile_capacity == 0 and fma.name == amx.name
    assert fma.peak(DType.BFLOAT16) == fma.peak(DType.FLOAT32) == amx.peak(DType.FLOAT32)
    # AVX512-BF16 without AMX: the machine's bf16 rate is not chainfuse's (it widens to fp32)
    avx = dataclasses.replace(fma, isa=fma.isa | {Isa.AVX512_BF16},
                              peak_flops=(*fma.peak_flops, (DType.BFLOAT16, 2 * 128e9)))  # fmt: skip
    assert avx.for_chain(DType.BFLOAT16).peak(DType.BFLOAT16) == avx.peak(DType.FLOAT32)
    assert avx.for_chain(DType.FLOAT16).peak(DType.FLOAT16) == avx.peak(DType.FLOAT32)
    gpu = Hardware.preset("h100")  # tensor cores: their 16-bit peak is the kernels' own
    assert gpu.for_chain(DType.BFLOAT16) is gpu


def test_bf16_chains_on_amx_tile_for_the_amx_block() -> None:
    amx = Hardware.preset(AMX_PRESET)
    chain = workloads.chain_of("bert-base", "relu", "bfloat16")
    assert register_block(chain, amx) == (AMX_BF16_32X32.mr, AMX_BF16_32X32.nr) == (32, 32)
    assert register_block(chain, amx.fp32_units()) != (32, 32)
    assert register_block(workloads.chain_of("bert-base", "relu"), amx) != (32, 32)
    tiles = plan(chain, amx, threads=1).tiles
    assert all(t % 32 == 0 or t == chain.extents[n] for _, lv in tiles for n, t in lv if n in "ml")


@pytest.mark.parametrize(
    ("workload", "between", "threads"),
    [("bert-base", "relu", None), ("mixer-b-32-c", "gelu", 1)],
)
def test_amx_bf16_plans_differ_from_fp32_and_are_memory_bound(
    workload: str, between: str, threads: int | None
) -> None:
    amx = Hardware.preset(AMX_PRESET)
    fp32 = plan(workloads.chain_of(workload, between), amx, threads=threads)
    bf16 = plan(workloads.chain_of(workload, between, "bfloat16"), amx, threads=threads)
    assert fp32.bound == "compute" and bf16.bound != "compute"  # the engine leaves memory
    assert bf16.flops == fp32.flops
    # compute at the AMX peak, 16x the fp32 FMA rate (up to the deal's imbalance)
    assert fp32.compute_time_s / 20 < bf16.compute_time_s < fp32.compute_time_s / 8
    assert bf16.register_block == (32, 32) != fp32.register_block
    assert bf16.tiles != fp32.tiles
    # the same bf16 chain on the machine's FMA units: compute-bound again, as fp32
    fma = plan(workloads.chain_of(workload, between, "bfloat16"), amx.fp32_units(), threads=threads)
    assert fma.bound == "compute" and fma.predicted_time_s > 4 * bf16.predicted_time_s


def test_bf16_plan_without_amx_is_planned_at_the_fp32_rate() -> None:
    hw = Hardware.preset("xeon-gold-6240")
    chain = builders.gemm_chain(2, 64, 32, 48, 80, "relu", "bfloat16")
    flops = 2 * 2 * 64 * 80 * (48 + 32)
    assert plan(chain, hw, threads=1).compute_time_s >= flops / hw.peak(DType.FLOAT32) * 0.99
