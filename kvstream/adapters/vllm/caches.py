"""vLLM's registered KV tensors as a kvstream layout: one job, no vLLM import.

Which arrangement a tensor holds is vLLM's attention backend's business, never its shape's:
vLLM 0.32 hands the CPU backend and the GPU backends the same 4-D shape
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` with other bytes inside. So the
worker asks vLLM which backend and which KV cache layout it runs (``Attention``) and this
module maps that onto kvstream's arrangements:

* ``CPU_ATTN``: ``cpu_hnbc`` (per block and head, K as ``[head_dim, block_size]``, then V);
* an MLA backend: ``mla`` (one latent per token: ``[num_blocks, 1, block_size, dim]``);
* every other backend (FlashAttention, FlashInfer, Triton, ...) in vLLM's layout
  ``LBHNC`` (what the connector asks for): ``hnd_kv`` (per block, head and token, K then V:
  FlashAttention splits the last dimension so); in ``LBNHC`` (vLLM's fallback when a
  backend refuses LBHNC): ``nhd_kv``, from the layer view vLLM hands out permuted back to
  its memory order. Layouts with blocks outside layers are refused (one tensor per layer).

An ``fp8`` cache is allocated as ``uint8``; it is viewed as the FP8 type vLLM's kernels
read, so its blocks travel with the per-layer scales and are never re-quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstream._exceptions import AdapterError
from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["Attention", "layer_indices", "layout_of_vllm_caches"]

# vLLM's cache_dtype -> the dtype its kernels read the uint8 storage as
_FP8_CACHE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class Attention:
    """What vLLM says of its attention: backend name (``AttentionBackend.get_name()``),
    MLA or not, the resolved KV cache layout (``KVCacheLayout`` member name, "" unknown)
    and ``cache_config.cache_dtype``."""

    backend: str
    mla: bool = False
    kv_layout: str = ""
    cache_dtype: str = "auto"


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


def arrangement_of(attention: Attention) -> str:
    """kvstream's arrangement for what vLLM reports (``AdapterError`` when none fits)."""
    if attention.mla:
        return "mla"
    if attention.backend == "CPU_ATTN":
        return "cpu_hnbc"
    if attention.kv_layout == "LBHNC":
        return "hnd_kv"
    if attention.kv_layout == "LBNHC":
        return "nhd_kv"
    raise AdapterError(f"vLLM's {attention.backend} runs KV cache layout "
                       f"{attention.kv_layout or 'unknown'}: kvstream reads LBHNC and LBNHC "
                       "(one tensor per layer), or set kv_connector_extra_config.arrangement")


def _as_arranged(t: torch.Tensor, arrangement: str) -> torch.Tensor:
    """vLLM's per-layer view as the contiguous tensor of ``arrangement``."""
    if arrangement == "mla" and t.dim() == 4:  # [nb, 1, bs, d]
        if t.shape[1] != 1:
            raise AdapterError(f"an MLA cache has one latent per token, got {tuple(t.shape)}")
        t = t.squeeze(1)
    elif arrangement == "nhd_kv" and t.dim() == 4:  # vLLM's [nb, h, bs, c] view, NHD memory
        t = t.permute(0, 2, 1, 3)
    if not t.is_contiguous():
        raise AdapterError(f"KV cache of shape {tuple(t.shape)} (stride {t.stride()}) is not "
                           f"the contiguous {arrangement} arrangement: use a layer-outermost "
                           "KV layout")
    return t


def _dims(arrangement: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(KV heads, block size, head dim) of a layer tensor of ``arrangement``."""
    if arrangement in ("cpu_hnbc", "hnd_kv"):  # [nb, h, bs, 2d]
        _, h, bs, d2 = shape
        return h, bs, d2 // 2
    if arrangement == "nhd_kv":  # [nb, bs, h, 2d]
        _, bs, h, d2 = shape
        return h, bs, d2 // 2
    if arrangement == "mla":  # [nb, bs, d]
        _, bs, d = shape
        return 1, bs, d
    if arrangement == "flash_nhd":
        _, _, bs, h, d = shape
        return h, bs, d
    if arrangement == "flash_hnd":
        _, _, h, bs, d = shape
        return h, bs, d
    raise AdapterError(f"arrangement {arrangement!r} is not supported for vLLM")


def layout_of_vllm_caches(kv_caches: dict[str, torch.Tensor], *,
                          attention: Attention | None = None, arrangement: str | None = None
                          ) -> tuple[KVLayout, list[torch.Tensor]]:
    """The kvstream layout of vLLM's per-layer KV tensors, and the tensors in layer order
    (views of vLLM's memory, in the arrangement's shape). Layers sharing one tensor (KV
    sharing) are registered once. The arrangement comes from ``attention`` (what vLLM
    reports), or from an explicit ``arrangement`` (the extra config's), which wins."""
    if not kv_caches:
        raise AdapterError("vLLM registered no KV cache tensors")
    if arrangement is None:
        if attention is None:
            raise AdapterError("vLLM did not say which attention backend it runs: set "
                               "kv_connector_extra_config.arrangement")
        arrangement = arrangement_of(attention)
    fp8 = _FP8_CACHE.get(attention.cache_dtype) if attention is not None else None

    layers: list[torch.Tensor] = []
    seen: set[int] = set()
    for name in sorted(kv_caches, key=_order):
        t = kv_caches[name]
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        try:
            t = _as_arranged(t, arrangement)
        except AdapterError as exc:
            raise AdapterError(f"KV cache of {name}: {exc}") from None
        if fp8 is not None and str(t.dtype) == "torch.uint8":
            import torch

            t = t.view(getattr(torch, fp8))
        layers.append(t)
    first = layers[0]
    shape = tuple(first.shape)
    if any(tuple(t.shape) != shape or t.dtype != first.dtype for t in layers):
        raise AdapterError("vLLM's KV layers differ in shape or dtype (hybrid models are not "
                           "supported yet)")
    h, bs, d = _dims(arrangement, shape)
    layout = KVLayout(num_layers=len(layers), num_kv_heads=h, head_dim=d, block_size=bs,
                      dtype=str(first.dtype).removeprefix("torch."), arrangement=arrangement)
    return layout, layers
