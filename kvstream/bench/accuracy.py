"""How much a wire codec changes the KV it moves, and whether attention notices.

A codec is judged on two things: the element error against the bound it documents
(``scheme.error_bound``), and what the error does downstream: the attention output
``softmax(q k^T / sqrt(d)) v`` computed with the original and with the decoded K/V.
The first proves the codec keeps its promise on every element; the second is what a
user cares about. Attention's sensitivity is the model's, not the codec's: the report
gives each source's conditioning (logit spread, top softmax weight) and two yardsticks
on the same KV: an fp8 cache with one scale per layer (what vLLM's
``kv_cache_dtype="fp8"`` keeps) and a bfloat16 cache.

Both are measured on a real round trip: every block goes through ``LayerCodec.encode``
into a wire buffer and ``decode`` into a separate destination cache, the path the
streams take. Sources: synthetic N(0,1) data with the outliers real K caches have, and
the K/V and queries of tiny transformers Llamas (no hub): one trained once and committed
(sharp copy heads, like a real model's induction heads), one random and harsh, both the
same on every machine.

The sources are made in ``kvstream.bench.sources`` (their functions are re-exported
here). Used by ``kvstream bench --codec fp8_e4m3 --accuracy`` and by the unit tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvstream._exceptions import ConfigError
from kvstream.bench.sources import QUERY_TOKENS as QUERY_TOKENS
from kvstream.bench.sources import _kv_heads as _kv_heads
from kvstream.bench.sources import _tiny_llama as _tiny_llama
from kvstream.bench.sources import random_kv as random_kv
from kvstream.bench.sources import random_with_outliers as random_with_outliers
from kvstream.bench.sources import tiny_llama_kv as tiny_llama_kv
from kvstream.layout import KVLayout
from kvstream.quant.scheme import check_codec, error_bound, scale_groups, wire_layer_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "AccuracyReport",
    "format_report",
    "measure",
    "random_kv",
    "random_with_outliers",
    "report",
    "tiny_llama_kv",
]

log = logging.getLogger("kvstream.quant")

# Relative error only means something away from zero: elements below this fraction of
# their scale group's max fall into e4m3's subnormals, where the bound is absolute.
REL_FLOOR: float = 2.0 ** -7
# What the float16 destination may add in its own subnormals (error_bound's "+ 2^-24").
ABS_SLACK: float = 2.0 ** -24

Tamper = Callable[[int, "torch.Tensor"], None]


class AccuracyReport(msgspec.Struct, kw_only=True):
    """One codec on one data source.

    ``max_rel_err`` / ``mean_rel_err`` are ``|y - x| / |x|`` over the elements with
    ``|x| > max|group| * 2^-7`` only (smaller ones are in e4m3's subnormal range, covered
    by the absolute term of the bound). ``within_bound``: every element satisfies
    ``|y - x| <= rel*|x| + abs_frac*max|group| + 2^-24`` with ``scheme.error_bound``'s
    constants and ``max|group|`` per scale group (``scheme.scale_groups``). The ``attn_*``
    fields compare attention outputs per (query, head) vector in float32; each query
    attends to every cached token, as a decode step after the prompt does.
    """

    source: str
    codec: str  # the codec, or the yardstick's name
    dtype: str
    values: int
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float
    mean_rel_err: float
    rmse_over_rms: float
    within_bound: bool
    attn_cosine_min: float
    attn_cosine_mean: float
    attn_max_abs_dev: float
    wire_bytes: int
    raw_bytes: int
    # The source's attention, from the original KV: std of the logits q.k/sqrt(d) and the
    # mean top softmax weight (near 1: one-hot attention, where any K error can flip it).
    attn_logit_std: float = 0.0
    attn_top_weight: float = 0.0


Yardstick = Callable[[KVLayout, list["torch.Tensor"]], tuple[list["torch.Tensor"], int]]


def fp8_per_tensor(layout: KVLayout, layers: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """An fp8 e4m3 cache with one scale for K and one for V per layer (amax / 448), as
    vLLM keeps with ``kv_cache_dtype="fp8"`` and dynamic scales: the accuracy its users
    already accept."""
    import torch

    if layout.arrangement != "flash_nhd":
        raise ConfigError("the per-tensor yardstick reads flash_nhd caches")
    out = []
    for t in layers:
        y = torch.empty_like(t)
        for i in (0, 1):
            x = t[i].float()
            s = (x.abs().amax() / 448.0).clamp_min(2.0 ** -126)
            y[i] = ((x / s).to(torch.float8_e4m3fn).float() * s).to(t.dtype)
        out.append(y)
    return out, sum(t.numel() for t in layers) + 8 * len(layers)


def bf16_cache(layout: KVLayout, layers: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """The KV kept in bfloat16, as most engines keep it."""
    import torch

    return ([t.to(torch.bfloat16).to(t.dtype) for t in layers],
            2 * sum(t.numel() for t in layers))


YARDSTICKS: dict[str, Yardstick] = {"fp8 per-tensor (vLLM cache)": fp8_per_tensor,
                                    "bf16 cache": bf16_cache}


def _round_trip(layout: KVLayout, layers: Sequence[torch.Tensor], codec: str
                ) -> tuple[list[torch.Tensor], int]:
    """Encode every block of every layer into a wire buffer and decode it into a fresh
    cache (NaN-filled, so a block the codec forgets to write cannot pass)."""
    import torch

    from kvstream.memory import RegisteredKV
    from kvstream.quant.codec import LayerCodec

    src = RegisteredKV(layout, layers)
    out = [torch.full_like(t, math.nan) for t in layers]
    if codec == "none":
        for o, t in zip(out, layers, strict=True):
            o.copy_(t)
        return out, layout.num_layers * src.num_blocks * layout.block_bytes
    dst = RegisteredKV(layout, out)
    enc, dec = LayerCodec(src, codec), LayerCodec(dst, codec)
    blocks = src.block_map(list(range(src.num_blocks)))
    buf = torch.empty(enc.layer_bytes(len(blocks)), dtype=torch.uint8, device=src.device)
    for layer in range(layout.num_layers):
        enc.encode(layer, blocks, buf)
        dec.decode(layer, blocks, buf)
    return out, layout.num_layers * wire_layer_bytes(layout, codec, len(blocks))



def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [Hq, n, d]``, ``k, v [Hkv, T, d]`` -> ``[Hq, n, d]``, float32, GQA by repetition."""
    import torch

    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v


def measure(layout: KVLayout, layers: list[torch.Tensor], queries: torch.Tensor | None, *,
            codec: str = "fp8_e4m3", source: str, yardstick: str | None = None,
            _tamper: Tamper | None = None) -> AccuracyReport:
    """Round-trip ``layers`` (the engine tensors of ``layout``) through ``codec`` and
    measure the error. ``queries``: ``[num_layers, num_query_heads, n_q, head_dim]``
    (query head ``h`` reads KV head ``h // (num_query_heads // num_kv_heads)``), or None
    for fixed-seed N(0,1) queries, one per KV head. ``_tamper(layer, decoded)`` may alter
    the decoded tensors in place before measuring (tests prove the metrics can fail).
    ``yardstick`` (a ``YARDSTICKS`` name) replaces the codec's round trip by that cache.
    Raises ConfigError for an unknown codec or, in the attention part, for ``mla``.
    """
    import torch

    check_codec(codec)
    if yardstick is not None:
        decoded, wire = YARDSTICKS[yardstick](layout, layers)
        codec = yardstick
    else:
        decoded, wire = _round_trip(layout, layers, codec)
    if _tamper is not None:
        for i, t in enumerate(decoded):
            _tamper(i, t)
    if queries is None:
        gen = torch.Generator().manual_seed(1234)
        queries = torch.randn(layout.num_layers, layout.num_kv_heads, QUERY_TOKENS,
                              layout.head_dim, generator=gen)
    if (queries.dim() != 4 or queries.shape[0] != layout.num_layers
            or queries.shape[1] % layout.num_kv_heads or queries.shape[3] != layout.head_dim):
        raise ConfigError(f"queries {tuple(queries.shape)} do not fit {layout.describe()}")

    # A yardstick (and "none", which must come back exact anyway) is held to the fp8_e4m3
    # bound: the one it competes with.
    rel_c, abs_c = error_bound(layout.dtype, "int8" if codec == "int8" else "fp8_e4m3")
    p, q_, r, s = scale_groups(layout)
    nb = layout.num_blocks_of(tuple(layers[0].shape))
    n = abs_sum = sq_err = sq_x = rel_sum = 0.0
    n_rel = 0
    max_abs = max_rel = attn_dev = 0.0
    ok = True
    cosines = []
    logit_std, top_w = [], []
    for i, (x_t, y_t) in enumerate(zip(layers, decoded, strict=True)):
        x = x_t.float().reshape(layout.chunks_per_block, nb, p, q_, r, s)
        y = y_t.float().reshape_as(x)
        err = (y - x).abs()
        gmax = x.abs().amax(dim=(3, 5), keepdim=True)
        ax = x.abs()
        # NaN (an unwritten or corrupt element) makes ``<=`` False, and max() NaN: both fail.
        ok = ok and bool((err <= rel_c * ax + abs_c * gmax + ABS_SLACK).all())
        mask = ax > gmax * REL_FLOOR
        rel = err[mask] / ax[mask]
        n += err.numel()
        abs_sum += float(err.double().sum())
        sq_err += float(err.double().square().sum())
        sq_x += float(x.double().square().sum())
        max_abs = max(max_abs, float(err.max()))
        if rel.numel():
            n_rel += rel.numel()
            rel_sum += float(rel.double().sum())
            max_rel = max(max_rel, float(rel.max()))
        qi = queries[i].float()
        k_x = _kv_heads(layout, x_t)[0]
        logits = qi @ k_x.repeat_interleave(qi.shape[0] // k_x.shape[0], 0).transpose(1, 2)
        logits = logits / math.sqrt(qi.shape[-1])
        logit_std.append(float(logits.std()))
        top_w.append(float(torch.softmax(logits, -1).amax(-1).mean()))
        o_x = _attention(qi, *_kv_heads(layout, x_t))
        o_y = _attention(qi, *_kv_heads(layout, y_t))
        cosines.append(torch.nn.functional.cosine_similarity(o_x, o_y, dim=-1).flatten())
        attn_dev = max(attn_dev, float((o_x - o_y).abs().max()))
    cos = torch.cat(cosines).nan_to_num(nan=-1.0)  # a NaN output is as wrong as it gets
    return AccuracyReport(
        source=source, codec=codec, dtype=layout.dtype, values=int(n),
        max_abs_err=max_abs, mean_abs_err=abs_sum / n,
        max_rel_err=max_rel, mean_rel_err=rel_sum / n_rel if n_rel else 0.0,
        rmse_over_rms=math.sqrt(sq_err / sq_x) if sq_x else 0.0,
        within_bound=ok,
        attn_cosine_min=float(cos.min()), attn_cosine_mean=float(cos.mean()),
        attn_max_abs_dev=attn_dev,
        wire_bytes=wire, raw_bytes=layout.num_layers * nb * layout.block_bytes,
        attn_logit_std=sum(logit_std) / len(logit_std),
        attn_top_weight=sum(top_w) / len(top_w),
    )


def report(codecs: Sequence[str] = ("fp8_e4m3", "int8"), dtype: str = "float16"
           ) -> list[AccuracyReport]:
    """The standard sources: random and random+outliers on the bench layout cut to 4 layers
    x 64 blocks, and real KV of the trained tiny Llama and of the harsh random-init one
    (skipped, with a warning, where transformers is not installed); each through every
    codec of ``codecs`` and the yardsticks."""
    for codec in codecs:
        check_codec(codec)
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    sources: list[tuple[str, KVLayout, list[torch.Tensor], torch.Tensor | None]] = [
        ("random", layout, random_kv(layout, 64), None),
               ("random+outliers", layout, random_with_outliers(layout, 64), None)]
    try:
        for name, trained in (("tiny-llama", True), ("tiny-llama-init0.5", False)):
            sources.append((name, *tiny_llama_kv(dtype=dtype, trained=trained)))
    except ImportError as exc:
        log.warning("tiny-llama accuracy skipped: %s (pip install transformers)", exc)
    out = []
    for name, lay, layers, queries in sources:
        out += [measure(lay, layers, queries, codec=c, source=name) for c in codecs]
        out += [measure(lay, layers, queries, source=name, yardstick=y) for y in YARDSTICKS]
    return out



def format_report(reports: Sequence[AccuracyReport]) -> str:
    """A plain-text table, one row per source."""
    head = ("source", "codec / cache", "dtype", "values", "max abs", "mean abs", "max rel",
            "mean rel", "rmse/rms", "bound", "cos min", "cos mean", "attn dev", "wire/raw",
            "logit std", "top w")
    rows = [head]
    for r in reports:
        rows.append((r.source, r.codec, r.dtype, f"{r.values:,}", f"{r.max_abs_err:.3g}",
                     f"{r.mean_abs_err:.3g}", f"{r.max_rel_err:.4f}", f"{r.mean_rel_err:.4f}",
                     f"{r.rmse_over_rms:.4f}", "ok" if r.within_bound else "VIOLATED",
                     f"{r.attn_cosine_min:.6f}", f"{r.attn_cosine_mean:.6f}",
                     f"{r.attn_max_abs_dev:.3g}", f"{r.wire_bytes / r.raw_bytes:.3f}",
                     f"{r.attn_logit_std:.1f}", f"{r.attn_top_weight:.2f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if c < 3 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    return "\n".join(lines)
