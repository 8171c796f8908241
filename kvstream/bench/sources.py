"""The KV that ``kvstream.bench.accuracy`` measures codecs on, and how to read it by head.

Seeded synthetic caches (plain N(0,1), and N(0,1) with the channel outliers and spikes
real K caches have) and the post-RoPE K/V and queries of tiny transformers Llamas made on
this machine (no hub): the committed trained one and a harsh random-init one. Every
source is the same on every machine. ``_kv_heads`` / ``_write_k`` view a layer's K and V
as ``[heads, tokens, d]`` in each arrangement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstream._exceptions import ConfigError
from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["QUERY_TOKENS", "random_kv", "random_with_outliers", "tiny_llama_kv"]

# Queries taken per layer: those of the prompt's last tokens.
QUERY_TOKENS: int = 16


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
    elif arr == "cpu_hnbc":  # [nb, h, bs, 2*d]: per block and head K as [d, bs], V [bs, d]
        nb, bs = t.shape[0], layout.block_size
        k = t.reshape(nb, h, 2, d, bs)[:, :, 0].permute(1, 0, 3, 2).reshape(h, -1, d)
        v = t.reshape(nb, h, 2, bs, d)[:, :, 1].transpose(0, 1).reshape(h, -1, d)
    else:
        raise ConfigError(f"attention accuracy needs separate K and V; {arr} has none")
    return k.float(), v.float()


def random_kv(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Plain N(0,1) KV: attention logits with a std near 1, as a trained model's heads
    mostly are. Fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.tensor_shape(num_blocks), generator=gen)
            .to(getattr(torch, layout.dtype)) for _ in range(layout.num_layers)]


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
    elif arr == "cpu_hnbc":  # K per block and head as [d, bs]
        nb, bs = t.shape[0], layout.block_size
        t.view(nb, h, 2, d, bs)[:, :, 0].copy_(k.reshape(h, nb, bs, d).permute(1, 0, 3, 2))
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
        layer: Any = cache.layers[i]  # a full-attention layer of this Llama: keys, values
        k, v = layer.keys[0], layer.values[0]  # [h, tokens, d]
        kv = torch.stack([x.transpose(0, 1).reshape(nb, block, layout.num_kv_heads, head_dim)
                          for x in (k, v)])
        layers.append(kv.to(getattr(torch, dtype)).contiguous())
    return layout, layers, torch.stack(queries)


