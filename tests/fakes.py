"""Test doubles and small builders shared by the unit and integration suites."""

from __future__ import annotations

import torch

from kvstream.layout import KVLayout


class FakeClock:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def small_layout(arrangement: str = "flash_nhd", layers: int = 4) -> KVLayout:
    heads = 1 if arrangement == "mla" else 2
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=32, block_size=8,
                    dtype="float16", arrangement=arrangement)


def cache(layout: KVLayout, num_blocks: int, *, fill: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = layout.tensor_shape(num_blocks)
    n = layout.num_layers * layout.tensors_per_layer  # split: K of every layer, then V
    if fill:
        return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(n)]
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(n)]
