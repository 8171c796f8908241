"""A custom engine on kvstream, for real: a small transformers Llama whose KV lives in a
paged cache shared with a local kvstream sidecar. One instance prefills, another decodes
from the KV that kvstream moved, and the greedy tokens match a colocated run.

    python examples/custom_engine.py          # needs: pip install transformers

Processes: NATS, two `kvstream sidecar`s, a prefill engine and a decode engine. The engines
have no NATS connection and no UCX worker; they talk to their sidecar over a Unix socket
with the synchronous `kvstream.BlockingClient`.

What an integrator copies from here:
  1. allocate the paged KV cache with `kvstream.SharedKV` and register it once;
  2. decode: reserve blocks for the request (`expect`) and tell the router their ids;
  3. prefill: `push` to the decode instance, and call `layer_ready(L)` as soon as layer L's
     KV is in the paged cache (here: a forward hook per decoder layer), so layer L travels
     while later layers still compute;
  4. decode: `wait_layer(L)` / `wait()`, then run attention over the blocks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from kvstream import BlockingClient, EmbeddedNats, KVLayout, SharedKV

BLOCK = 16
NUM_BLOCKS = 64
MAX_NEW = 16


# -- the model: made at run time, no hub --------------------------------------------------
def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=0.5)  # 0.02 repeats one token
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def layout_of(model: Any) -> KVLayout:
    cfg = model.config
    return KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.hidden_size // cfg.num_attention_heads, block_size=BLOCK,
                    dtype="float32", arrangement="flash_nhd")  # [2, blocks, BLOCK, heads, dim]


def prompt_ids(n: int = 40, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=gen).tolist()


# -- greedy decoding over a DynamicCache ----------------------------------------------------
@torch.no_grad()
def decode_steps(model: Any, cache: Any, first: int, n: int) -> list[int]:
    tokens, last = [first], first
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[last]]), cache=cache, use_cache=True)
        last = int(out.logits[0, -1].argmax())
        tokens.append(last)
    return tokens


@torch.no_grad()
def colocated(prompt: list[int], n: int = MAX_NEW) -> list[int]:
    from transformers import DynamicCache

    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return decode_steps(model, cache, int(out.logits[0, -1].argmax()), n)


# -- the paged cache: blocks of BLOCK tokens per layer ---------------------------------------
def write_blocks(layer_kv: torch.Tensor, blocks: list[int], k: torch.Tensor, v: torch.Tensor
                 ) -> None:
    """k, v: (1, heads, seq, dim) -> the request's blocks of one layer's paged tensor."""
    seq = k.shape[2]
    for plane, x in ((0, k), (1, v)):
        flat = x[0].transpose(0, 1)  # (seq, heads, dim)
        padded = torch.zeros((len(blocks) * BLOCK, *flat.shape[1:]), dtype=flat.dtype)
        padded[:seq] = flat
        layer_kv[plane, blocks] = padded.view(len(blocks), BLOCK, *flat.shape[1:])


def read_blocks(layer_kv: torch.Tensor, blocks: list[int], seq: int) -> tuple[torch.Tensor, ...]:
    out = []
    for plane in (0, 1):
        flat = layer_kv[plane, blocks].reshape(-1, *layer_kv.shape[3:])[:seq]  # (seq, h, d)
        out.append(flat.transpose(0, 1).unsqueeze(0).contiguous())
    return tuple(out)


# -- the two engine processes ---------------------------------------------------------------
def prefill_engine(sock: str, inbox: Any, outbox: Any) -> None:
    from transformers import DynamicCache

    model = tiny_llama()
    layout = layout_of(model)
    kv = SharedKV.create(layout, NUM_BLOCKS)
    with BlockingClient(sock) as client:
        client.register_kv(layout, kv)
        request = inbox.get()  # {"request_id", "prompt", "decode_instance", "dst_blocks"}
        prompt = request["prompt"]
        blocks = list(range(3, 3 + -(-len(prompt) // BLOCK)))  # our allocator's choice
        handle = client.push(request["request_id"], request["decode_instance"], blocks,
                             dst_blocks=request["dst_blocks"])
        cache = DynamicCache(config=model.config)

        def ship(index: int) -> Any:
            def hook(_module: Any, _args: Any, _output: Any) -> None:
                layer = cache.layers[index]
                write_blocks(kv.layers[index], blocks, layer.keys, layer.values)
                handle.layer_ready(index)  # leaves now; later layers are still computing
            return hook

        hooks = [m.register_forward_hook(ship(i)) for i, m in enumerate(model.model.layers)]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        for h in hooks:
            h.remove()
        result = handle.wait()
        outbox.put({"first_token": int(out.logits[0, -1].argmax()), "bytes": result.bytes})


def decode_engine(sock: str, inbox: Any, outbox: Any, results: Any) -> None:
    from transformers import DynamicCache

    model = tiny_llama()
    layout = layout_of(model)
    kv = SharedKV.create(layout, NUM_BLOCKS)
    with BlockingClient(sock) as client:
        client.register_kv(layout, kv)
        prompt = prompt_ids()
        blocks = [40, 12, 33][: -(-len(prompt) // BLOCK)]  # scattered, as a paged cache hands out
        handle = client.expect("req-1", blocks, src="prefill-0")
        outbox.put({"request_id": "req-1", "prompt": prompt, "decode_instance": "decode-0",
                    "dst_blocks": blocks})
        cache = DynamicCache(config=model.config)
        for layer in range(layout.num_layers):
            handle.wait_layer(layer)  # a real engine would start this layer's attention here
            cache.update(*read_blocks(kv.layers[layer], blocks, len(prompt)), layer)
        handle.wait()
        first = inbox.get()["first_token"]
        results.put(decode_steps(model, cache, first, MAX_NEW))


def run(nats_url: str | None = None) -> tuple[list[int], list[int]]:
    """Disaggregated and colocated greedy tokens for the same prompt."""
    with tempfile.TemporaryDirectory(prefix="kvstream-example-") as tmp, \
            (EmbeddedNats() if nats_url is None else _Given(nats_url)) as nats:
        sidecars, socks = [], {}
        for name in ("prefill-0", "decode-0"):
            socks[name] = os.path.join(tmp, f"{name}.sock")
            sidecars.append(subprocess.Popen(
                [sys.executable, "-m", "kvstream.tools.cli", "sidecar", "--instance-id", name,
                 "--socket", socks[name], "--nats-url", nats.url, "--log-level", "warning"]))
        try:
            for sock in socks.values():
                deadline = time.monotonic() + 60
                while not os.path.exists(sock):
                    if time.monotonic() > deadline:
                        raise RuntimeError("sidecar did not start")
                    time.sleep(0.05)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            router = _Router()
            engines = [
                ctx.Process(target=prefill_engine,
                            args=(socks["prefill-0"], router.to_p, router.from_p), daemon=True),
                ctx.Process(target=decode_engine,
                            args=(socks["decode-0"], router.to_d, router.from_d, results),
                            daemon=True)]
            for e in engines:
                e.start()
            try:
                router.relay()
                disaggregated = results.get(timeout=120)
            finally:
                for e in engines:
                    e.join(30)
                    if e.is_alive():
                        e.terminate()
        finally:
            for s in sidecars:
                s.terminate()
                s.wait(15)
    return disaggregated, colocated(prompt_ids())


class _Given:
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> _Given:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Router:
    """Stands in for the P/D proxy: decode's block ids go to prefill, the first token back.
    One queue per direction and per engine, so nobody reads back its own message."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.to_p, self.from_p = ctx.Queue(), ctx.Queue()
        self.to_d, self.from_d = ctx.Queue(), ctx.Queue()

    def relay(self) -> None:
        self.to_p.put(self.from_d.get(timeout=120))  # the request, with the reserved block ids
        self.to_d.put(self.from_p.get(timeout=120))  # the first token


if __name__ == "__main__":
    disagg, coloc = run()
    print("disaggregated:", disagg)
    print("colocated:    ", coloc)
    print("same tokens:", disagg == coloc)
    sys.exit(0 if disagg == coloc else 1)
