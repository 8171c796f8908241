"""What vLLM (0.32) says of the attention its worker runs: the backend, MLA or not, the KV
cache layout the engine core resolved, the cache dtype, and an FP8 cache's per-layer
scales. Read in the worker after the model is loaded (``register_kv_caches``), where the
attention layers are in vLLM's forward context."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvstream._exceptions import AdapterError
from kvstream.adapters.vllm.caches import Attention, layer_indices

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

__all__ = ["attention_of", "cache_scales"]

log = logging.getLogger("kvstream.vllm")


def attention_of(vllm_config: VllmConfig) -> Attention:
    """The attention vLLM runs (``AdapterError`` for several backends at once: a hybrid
    model, not supported yet)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)
    names = sorted({b.get_name() for b in backends})
    if len(names) != 1:
        raise AdapterError(f"vLLM runs several attention backends ({', '.join(names)}): "
                           "hybrid models are not supported yet")
    cache = vllm_config.cache_config
    try:
        kv_layout = cache.get_resolved_kv_cache_layout().name
    except (AttributeError, ValueError):  # not resolved (tests) or another vLLM
        kv_layout = str(getattr(cache, "kv_cache_layout", "") or "")
    mla = any(b.is_mla() for b in backends) or bool(
        getattr(vllm_config.model_config, "use_mla", False))
    return Attention(backend=names[0], mla=mla, kv_layout=kv_layout,
                     cache_dtype=str(cache.cache_dtype))


def cache_scales(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> list[float]:
    """An FP8 cache's (k_scale, v_scale) per registered layer, in kvstream's layer order,
    from vLLM's attention layers (``_k_scale_float``, ``_v_scale_float``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers: dict[str, Any] = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    first: dict[int, str] = {}
    for name, index in layer_indices(kv_caches).items():
        first.setdefault(index, name)
    scales: list[float] = []
    for index in sorted(first):
        layer = layers.get(first[index])
        k = getattr(layer, "_k_scale_float", None)
        v = getattr(layer, "_v_scale_float", None)
        if not isinstance(k, float) or not isinstance(v, float):
            raise AdapterError(f"vLLM's layer {first[index]} has no FP8 KV scales")
        scales += [k, v]
    return scales
