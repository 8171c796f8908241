"""vLLM's registered KV tensors as a kvstream layout: one job, no vLLM import."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kvstream._exceptions import AdapterError
from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["layer_indices", "layout_of_vllm_caches"]


def _order(name: str) -> tuple[tuple[int, ...], str]:
    return tuple(int(n) for n in re.findall(r"\d+", name)) or (0,), name


def layer_indices(kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
    """vLLM's layer names -> the index of their tensor among the registered layers (layers
    sharing one tensor share its index), in ``layout_of_vllm_caches``' order."""
    index: dict[int, int] = {}
    out: dict[str, int] = {}
    for name in sorted(kv_caches, key=_order):
        out[name] = index.setdefault(kv_caches[name].data_ptr(), len(index))
    return out


def layout_of_vllm_caches(kv_caches: dict[str, torch.Tensor], *,
                          arrangement: str | None = None) -> tuple[KVLayout, list[torch.Tensor]]:
    """The kvstream layout of vLLM's per-layer KV tensors, and the tensors in layer order.

    vLLM 0.32 hands the CPU backend ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
    per layer (per block and head: K as [head_dim, block_size], then V as [block_size,
    head_dim]; ``cpu_hnbc``); FlashAttention
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Layers sharing one tensor (KV
    sharing) are registered once. Anything else needs an explicit ``arrangement``.
    """
    if not kv_caches:
        raise AdapterError("vLLM registered no KV cache tensors")

    layers: list[torch.Tensor] = []
    seen: set[int] = set()
    for name in sorted(kv_caches, key=_order):
        t = kv_caches[name]
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if not t.is_contiguous():
            raise AdapterError(f"KV cache of {name} is not contiguous (shape {tuple(t.shape)}, "
                               f"stride {t.stride()}): use a layer-outermost KV layout")
        layers.append(t)
    first = layers[0]
    shape = tuple(first.shape)
    if any(tuple(t.shape) != shape or t.dtype != first.dtype for t in layers):
        raise AdapterError("vLLM's KV layers differ in shape or dtype (hybrid models are not "
                           "supported yet)")
    dtype = str(first.dtype).removeprefix("torch.")
    if arrangement is None:
        if len(shape) == 4 and first.device.type == "cpu":
            arrangement = "cpu_hnbc"
        elif len(shape) == 5 and shape[0] == 2:
            arrangement = "flash_nhd"
        else:
            raise AdapterError(f"unknown vLLM KV layout {shape} on {first.device}; set "
                               "kv_connector_extra_config.arrangement")
    if arrangement == "cpu_hnbc":
        _, h, bs, d2 = shape
        d = d2 // 2
    elif arrangement == "flash_nhd":
        _, _, bs, h, d = shape
    elif arrangement == "flash_hnd":
        _, _, h, bs, d = shape
    else:
        raise AdapterError(f"arrangement {arrangement!r} is not supported for vLLM")
    layout = KVLayout(num_layers=len(layers), num_kv_heads=h, head_dim=d, block_size=bs,
                      dtype=dtype, arrangement=arrangement)
    return layout, layers
