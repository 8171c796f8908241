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

Used by ``kvstream bench --codec fp8_e4m3 --accuracy`` and by the unit tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvstream._exceptions import ConfigError
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
QUERY_TOKENS: int = 16

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

    from kvstream.dataplane.memory import RegisteredKV
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


def _kv_heads(layout: KVLayout, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[heads, tokens, d]``, tokens of all blocks in block order."""
    h, d = layout.num_kv_heads, layout.head_dim
    arr = layout.arrangement
    if arr == "flash_nhd":  # [2, nb, bs, h, d]
        k, v = (t[i].reshape(-1, h, d).transpose(0, 1) for i in (0, 1))
    elif arr == "flash_hnd":  # [2, nb, h, bs, d]
        k, v = (t[i].transpose(0, 1).reshape(h, -1, d) for i in (0, 1))
    elif arr == "blocks_first_nhd":  # [nb, 2, bs, h, d]
        k, v = (t[:, i].reshape(-1, h, d).transpose(0, 1) for i in (0, 1))
    elif arr == "cpu_hnbc":  # [nb, h, bs, 2*d], in memory [nb, h, 2, bs, d] (vLLM CPU)
        kv = t.reshape(t.shape[0], h, 2, -1, d)
        k, v = (kv[:, :, i].transpose(0, 1).reshape(h, -1, d) for i in (0, 1))
    else:
        raise ConfigError(f"attention accuracy needs separate K and V; {arr} has none")
    return k.float(), v.float()


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


def random_with_outliers(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """N(0,1) KV in ``layout`` with what makes real caches hard for a shared scale: in K,
    a few head_dim channels per head scaled x20-x50 (the channel outliers RoPE'd keys
    show); everywhere, ~0.1 % of values x100. Fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(num_blocks)
    h, d = layout.num_kv_heads, layout.head_dim
    out = []
    for _ in range(layout.num_layers):
        x = torch.randn(shape, generator=gen)
        k, _v = _kv_heads(layout, x) if layout.kv_factor == 2 else (x.view(h, -1, d), None)
        # Write the K channel outliers through a view of the same tensor; heads differ.
        gain = torch.ones(h, 1, d)
        for head in range(h):
            ch = torch.randperm(d, generator=gen)[:3]
            gain[head, 0, ch] = 20 + 30 * torch.rand(3, generator=gen)
        k_scaled = k * gain
        _write_k(layout, x, k_scaled)
        spikes = torch.rand(shape, generator=gen) < 1e-3
        x[spikes] *= 100
        out.append(x.to(getattr(torch, layout.dtype)).contiguous())
    return out


def _write_k(layout: KVLayout, t: torch.Tensor, k: torch.Tensor) -> None:
    """Inverse of ``_kv_heads`` for K only (``k [h, tokens, d]`` into ``t``)."""
    h, d = layout.num_kv_heads, layout.head_dim
    arr = layout.arrangement
    if arr == "flash_nhd":
        t[0].copy_(k.transpose(0, 1).reshape(t[0].shape))
    elif arr == "flash_hnd":
        t[0].copy_(k.reshape(h, t.shape[1], -1, d).transpose(0, 1))
    elif arr == "blocks_first_nhd":
        t[:, 0].copy_(k.transpose(0, 1).reshape(t[:, 0].shape))
    elif arr == "cpu_hnbc":
        t.view(t.shape[0], h, 2, -1, d)[:, :, 0].copy_(
            k.reshape(h, t.shape[0], -1, d).transpose(0, 1))
    else:  # mla: one latent, no K of its own
        t.copy_(k.reshape(t.shape))


def _tiny_llama(seed: int, tokens: int) -> Any:
    """examples/custom_engine.py's ``tiny_llama`` config (random init, std 0.5), with the
    weights drawn here in parameter-name order from one seeded CPU generator rather than by
    transformers' initialiser, so every machine and transformers version gets the same
    model (norm weights stay 1)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=max(512, tokens),
                      initializer_range=0.5)  # 0.02 repeats one token (ENGINES.md)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
    return model


def tiny_llama_kv(seed: int = 0, tokens: int = 256, *, dtype: str = "float16",
                  trained: bool = True) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    """Real K/V and queries of a tiny transformers Llama made on this machine (no hub).

    ``trained`` (the default): ``kvstream.bench.tiny_llama``'s committed model (the same
    weights on every machine), on a prompt of its copy language; its copy heads
    attend sharply, as a real model's induction heads do. Else examples/custom_engine.py's
    random init (initializer_range=0.5): a harsh source whose attention logits have a std
    of ~64, so softmax is near one-hot and even a bfloat16 cache moves the worst output.

    Runs ``tokens`` token ids (a multiple of 16), returns the flash_nhd layout (block 16,
    ``dtype``), its per-layer tensors holding the cache's post-RoPE K and V in block order,
    and the post-RoPE queries of the last 16 tokens,
    ``[num_layers, num_attention_heads, 16, head_dim]``. Raises ImportError without
    transformers.
    """
    import torch

    block = 16
    if tokens <= 0 or tokens % block:
        raise ConfigError(f"tokens must be a positive multiple of {block}, got {tokens}")
    gen = torch.Generator().manual_seed(seed + 1)
    if trained:
        from kvstream.bench.tiny_llama import copy_prompt, load_model

        model = load_model()
        ids = copy_prompt(gen, 1, tokens)
    else:
        model = _tiny_llama(seed, tokens)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    return _capture(model, ids, dtype, block)


def _capture(model: Any, ids: torch.Tensor, dtype: str, block: int
             ) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    """One forward pass: the cache's K/V in blocks and the last tokens' queries."""
    import torch
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                      head_dim=head_dim, block_size=block, dtype=dtype, arrangement="flash_nhd")
    queries: list[torch.Tensor] = [torch.empty(0)] * cfg.num_hidden_layers

    def grab(index: int) -> Callable[..., None]:
        # The attention's own inputs: q_proj of its hidden states, then its RoPE.
        def hook(attn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            q = attn.q_proj(hidden[:, -QUERY_TOKENS:])
            q = q.view(1, QUERY_TOKENS, -1, head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos[:, -QUERY_TOKENS:], sin[:, -QUERY_TOKENS:])
            queries[index] = q[0].float()
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    cache = DynamicCache(config=cfg)
    try:
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
    finally:
        for hd in handles:
            hd.remove()
    nb = ids.shape[1] // block
    layers = []
    for i in range(cfg.num_hidden_layers):
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]  # [h, tokens, d]
        kv = torch.stack([x.transpose(0, 1).reshape(nb, block, layout.num_kv_heads, head_dim)
                          for x in (k, v)])
        layers.append(kv.to(getattr(torch, dtype)).contiguous())
    return layout, layers, torch.stack(queries)


def report(codecs: Sequence[str] = ("fp8_e4m3", "int8"), dtype: str = "float16"
           ) -> list[AccuracyReport]:
    """The standard sources: random and random+outliers on the bench layout cut to 4 layers
    x 64 blocks, and real KV of the trained tiny Llama and of the harsh random-init one
    (skipped, with a warning, where transformers is not installed); each through every
    codec of ``codecs`` and the yardsticks."""
    for codec in codecs:
        check_codec(codec)
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    sources = [("random", layout, random_kv(layout, 64), None),
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


def random_kv(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Plain N(0,1) KV: attention logits with a std near 1, as a trained model's heads
    mostly are. Fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.tensor_shape(num_blocks), generator=gen)
            .to(getattr(torch, layout.dtype)) for _ in range(layout.num_layers)]


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
