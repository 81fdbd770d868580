"""The paper's workloads (docs/design.md, from Chimera's benchmark configs) as data, and their chains."""

from __future__ import annotations

from dataclasses import dataclass

from chainfuse.builders import conv_chain_spec, gemm_chain
from chainfuse.ir import Chain

__all__ = ["ALL", "CONV", "GEMM", "ConvWorkload", "GemmWorkload", "chain_of", "find", "names"]


@dataclass(frozen=True)
class GemmWorkload:
    """A batched GEMM chain `(batch, M, N, K, L)` from a model."""

    name: str
    batch: int
    M: int
    N: int
    K: int
    L: int

    @property
    def attention_shaped(self) -> bool:
        """The 12 workloads whose second GEMM reduces over a sequence (not the Mixer-C MLPs)."""
        return not self.name.endswith("-c")

    def chain(self, between: str | None = None, dtype: str = "float32") -> Chain:
        return gemm_chain(self.batch, self.M, self.N, self.K, self.L, between, dtype)


@dataclass(frozen=True)
class ConvWorkload:
    """Two convolutions, batch 1: `(C, H, W, K1, K2, stride1, stride2)` and kernel sizes."""

    name: str
    C: int
    H: int
    W: int
    K1: int
    K2: int
    stride1: int
    stride2: int
    R1: int = 3
    R2: int = 1

    def chain(self, between: str | None = None, dtype: str = "float32") -> Chain:
        return conv_chain_spec(
            1, self.C, self.H, self.W, self.K1, self.R1, self.R1, self.K2, self.R2, self.R2,
            stride=(self.stride1, self.stride2), padding=(self.R1 // 2, self.R2 // 2),
            between=between, dtype=dtype,
        )  # fmt: skip


GEMM: tuple[GemmWorkload, ...] = (
    GemmWorkload("bert-small", 8, 512, 64, 64, 512),
    GemmWorkload("bert-base", 12, 512, 64, 64, 512),
    GemmWorkload("bert-large", 16, 512, 64, 64, 512),
    GemmWorkload("vit-base-14", 12, 256, 64, 64, 256),
    GemmWorkload("vit-large-14", 16, 256, 64, 64, 256),
    GemmWorkload("vit-huge-14", 16, 256, 80, 80, 256),
    GemmWorkload("vit-base-16", 12, 208, 64, 64, 208),
    GemmWorkload("vit-large-16", 16, 208, 64, 64, 208),
    GemmWorkload("vit-huge-16", 16, 208, 80, 80, 208),
    GemmWorkload("mixer-s-32-s", 1, 512, 64, 64, 256),
    GemmWorkload("mixer-b-32-s", 1, 768, 64, 64, 384),
    GemmWorkload("mixer-l-32-s", 1, 1024, 64, 64, 512),
    GemmWorkload("mixer-s-32-c", 1, 64, 512, 512, 2048),
    GemmWorkload("mixer-b-32-c", 1, 64, 768, 768, 3072),
    GemmWorkload("mixer-l-32-c", 1, 64, 1024, 1024, 4096),
)

CONV: tuple[ConvWorkload, ...] = (
    ConvWorkload("yolo", 64, 112, 112, 192, 128, 2, 1),
    ConvWorkload("inception-v3", 32, 147, 147, 64, 80, 2, 1),
    ConvWorkload("darknet-19-a", 64, 56, 56, 128, 64, 1, 1),
    ConvWorkload("darknet-19-b", 128, 28, 28, 256, 128, 1, 1),
    ConvWorkload("squeezenet-1.1", 16, 227, 227, 64, 16, 4, 1),
    ConvWorkload("resnet50-1x1-3x3", 64, 56, 56, 64, 64, 1, 1, R1=1, R2=3),
    ConvWorkload("1x1-1x1-a", 64, 56, 56, 64, 64, 1, 1, R1=1, R2=1),
    ConvWorkload("1x1-1x1-b", 256, 56, 56, 256, 64, 1, 1, R1=1, R2=1),
)


ALL: tuple[GemmWorkload | ConvWorkload, ...] = (*GEMM, *CONV)


def names() -> tuple[str, ...]:
    return tuple(w.name for w in ALL)


def find(name: str) -> GemmWorkload | ConvWorkload:
    """A workload by name; an unknown name is an error listing the known ones."""
    for w in ALL:
        if w.name == name:
            return w
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(names())}")


def chain_of(name: str, between: str | None = None, dtype: str = "float32") -> Chain:
    return find(name).chain(between, dtype)
