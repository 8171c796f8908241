"""The proxy's side of KV-aware routing (``routing = "kv"``): the prompt's tokens, their
block hashes at each block size the engines use, one question to the routers' queue
group, and its answer as the instances to send the legs to.

Tokens: a prompt given as token ids is used as is; text (or chat messages) is tokenized
by a prefill engine's own ``/tokenize`` (the engine's tokenizer and chat template, so the
hashes are the ones its prefix cache computes). Anything that fails here routes the
request least-loaded instead: KV-aware routing is an optimisation, never a reason to fail.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvstream.control import messages as m
from kvstream.prefix import block_hashes
from kvstream.routing.directory import Directory, Instance

__all__ = ["block_sizes", "prompt_tokens", "route_request"]

log = logging.getLogger("kvstream.proxy")

MAX_TOKENS = 1 << 20


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and 0 < len(value) <= MAX_TOKENS and all(
            type(t) is int and 0 <= t < 1 << 31 for t in value):
        return value
    return None


async def prompt_tokens(session: aiohttp.ClientSession, engine: Instance, path: str,
                        body: Mapping[str, Any], headers: Mapping[str, str],
                        timeout: float) -> list[int] | None:
    """The prompt's token ids, None if they cannot be had (no prompt, engine failed)."""
    direct = _token_list(body.get("prompt"))
    if direct is not None:
        return direct
    ask: dict[str, Any] = {"model": body.get("model")} if body.get("model") else {}
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        ask["messages"] = body["messages"]
        for key in ("add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "tools"):
            if key in body:
                ask[key] = body[key]
    elif isinstance(body.get("prompt"), str):
        ask["prompt"] = body["prompt"]
    else:
        return None
    try:
        async with session.post(engine.url + "/tokenize", json=ask, headers=dict(headers),
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                log.debug("tokenize on %s answered %d", engine.url, resp.status)
                return None
            got = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("tokenize on %s failed: %r", engine.url, exc)
        return None
    return _token_list(got.get("tokens")) if isinstance(got, dict) else None


def block_sizes(directory: Directory) -> list[int]:
    """The block sizes of the announced engines (their hashes differ per size), at most 8."""
    sizes = {a.layout.block_size for a in directory.registry.instances()
             if a.layout is not None and a.endpoint}
    return sorted(sizes)[:8]


def route_request(tokens: list[int], sizes: list[int], inflight: Mapping[str, int],
                  request_id: str, recent: Mapping[str, int] | None = None) -> m.Route:
    """``recent``: the most legs in flight per URL lately (``inflight.py``)."""
    hashes = {size: block_hashes(tokens, size)[:m.MAX_ROUTE_BLOCKS] for size in sizes}
    return m.Route(request_id=request_id[:1024], hashes=hashes, tokens=len(tokens),
                   inflight={u: n for u, n in list(inflight.items())[:4096] if n > 0},
                   recent=dict(list((recent or {}).items())[:4096]))
