"""The analytical data-movement model: what a block loop nest moves, holds and computes.

Pure functions of (Chain, schedule, tiles, Hardware): `nest` (order, compute-at, legality),
`traffic` (bytes per level), `softmax` (online and causal softmax terms), `efficiency` (the micro-kernel's), `time` (`estimate`), `rank` (which plan to run).
"""

from chainfuse.model.efficiency import Efficiency, code_flops, efficiency, kernel_of
from chainfuse.model.nest import LoopKind, Nest, OpNest
from chainfuse.model.rank import TIE, choose, traffic
from chainfuse.model.softmax import (
    RESCALE_STEPS,
    causal_share,
    causal_softmax,
    computed_share,
    keys_share,
    rescale_factors,
    rescaled,
)
from chainfuse.model.time import Cost, code_level, estimate
from chainfuse.model.traffic import (
    LevelCost,
    compulsory_bytes,
    deal,
    example_dv,
    least_flops,
    level_cost,
    moved_bytes,
    splits,
)

__all__ = [
    "RESCALE_STEPS",
    "TIE",
    "Cost",
    "Efficiency",
    "LevelCost",
    "LoopKind",
    "Nest",
    "OpNest",
    "causal_share",
    "causal_softmax",
    "choose",
    "code_flops",
    "code_level",
    "compulsory_bytes",
    "computed_share",
    "deal",
    "efficiency",
    "estimate",
    "example_dv",
    "kernel_of",
    "keys_share",
    "least_flops",
    "level_cost",
    "moved_bytes",
    "rescale_factors",
    "rescaled",
    "splits",
    "traffic",
]
