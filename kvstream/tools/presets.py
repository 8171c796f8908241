"""Reference models, links and GPUs for the planner and the benchmark.

Model figures are from each model's published config (layers, KV heads,
head_dim, hidden size) and parameter count. Links are line rates in decimal
GB/s (1e9 bytes/s) per direction; the planner treats them as the effective
bandwidth unless the user passes ``--efficiency``. GPU figures are dense
BF16 tensor FLOP/s and HBM bandwidth from the vendors' data sheets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec

from kvstream._exceptions import ConfigError
from kvstream.layout import KVLayout

__all__ = ["GPUS", "LINKS", "MODELS", "GPUSpec", "LinkSpec", "ModelSpec", "get_gpu", "get_link",
           "get_model"]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    params: float  # parameters touched per token (active parameters for MoE)
    mla: bool = False
    note: str = ""

    def layout(self, *, dtype: str = "float16", block_size: int = 16) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=1 if self.mla else self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype,
            arrangement="mla" if self.mla else "flash_nhd",
        )


class LinkSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    gbytes_per_s: float
    rtt_us: float
    note: str = ""


class GPUSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    tflops_bf16: float
    hbm_tbytes_per_s: float


MODELS: Final[dict[str, ModelSpec]] = {
    m.name: m
    for m in (
        ModelSpec(name="llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128,
                  hidden_size=4096, params=6.74e9),
        ModelSpec(name="llama-2-13b", num_layers=40, num_kv_heads=40, head_dim=128,
                  hidden_size=5120, params=13.0e9),
        ModelSpec(name="llama-2-70b", num_layers=80, num_kv_heads=8, head_dim=128,
                  hidden_size=8192, params=69.0e9),
        ModelSpec(name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128,
                  hidden_size=4096, params=8.03e9),
        ModelSpec(name="llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128,
                  hidden_size=8192, params=70.6e9),
        ModelSpec(name="mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128,
                  hidden_size=4096, params=7.24e9),
        ModelSpec(name="qwen2.5-72b", num_layers=80, num_kv_heads=8, head_dim=128,
                  hidden_size=8192, params=72.7e9),
        # MLA caches one compressed latent per token and layer: kv_lora_rank 512 plus
        # the 64-dim decoupled RoPE key = 576 values, no separate V.
        ModelSpec(name="deepseek-v3", num_layers=61, num_kv_heads=1, head_dim=576,
                  hidden_size=7168, params=37e9, mla=True,
                  note="MLA latent 512 + rope 64 = 576 values/token/layer; 37B active of 671B"),
    )
}

LINKS: Final[dict[str, LinkSpec]] = {
    ln.name: ln
    for ln in (
        LinkSpec(name="nvlink4", gbytes_per_s=450.0, rtt_us=2.0,
                 note="H100 NVLink 4: 900 GB/s bidirectional"),
        LinkSpec(name="pcie5", gbytes_per_s=64.0, rtt_us=2.0, note="PCIe 5.0 x16"),
        LinkSpec(name="ib-400g", gbytes_per_s=50.0, rtt_us=5.0, note="InfiniBand NDR 400 Gb/s"),
        LinkSpec(name="roce-200g", gbytes_per_s=25.0, rtt_us=10.0, note="RoCE v2 200 Gb/s"),
        LinkSpec(name="100gbe", gbytes_per_s=12.5, rtt_us=20.0, note="100 Gb Ethernet, TCP"),
        LinkSpec(name="10gbe", gbytes_per_s=1.25, rtt_us=50.0, note="10 Gb Ethernet, TCP"),
    )
}

GPUS: Final[dict[str, GPUSpec]] = {
    g.name: g
    for g in (
        GPUSpec(name="a100", tflops_bf16=312.0, hbm_tbytes_per_s=2.0),
        GPUSpec(name="l40s", tflops_bf16=362.0, hbm_tbytes_per_s=0.864),
        GPUSpec(name="h100", tflops_bf16=989.0, hbm_tbytes_per_s=3.35),
        GPUSpec(name="h200", tflops_bf16=989.0, hbm_tbytes_per_s=4.8),
        GPUSpec(name="b200", tflops_bf16=2250.0, hbm_tbytes_per_s=8.0),
    )
}


S = TypeVar("S", bound=msgspec.Struct)


def _lookup(table: Mapping[str, S], kind: str, name: str) -> S:
    try:
        return table[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(table)}") from None


def get_model(name: str) -> ModelSpec:
    return _lookup(MODELS, "model", name)


def get_link(name: str) -> LinkSpec:
    return _lookup(LINKS, "link", name)


def get_gpu(name: str) -> GPUSpec:
    return _lookup(GPUS, "gpu", name)
