"""A custom engine's view of kvstream: a decode process reserves blocks, a prefill process
pushes its KV into them layer by layer while it is still "computing" later layers.

    python examples/push_layers.py            # starts its own nats-server on loopback

What an engine integrates is only this: register the per-layer KV tensors once, then per
request ``expect`` (decode) or ``push`` + ``layer_ready`` (prefill), and await layers.
"""

from __future__ import annotations

import multiprocessing as mp

import anyio
import torch

from kvstream import Agent, AgentConfig, EmbeddedNats, KVLayout

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16)  # flash_nhd
NUM_BLOCKS = 64


def prefill(nats_url: str, dst_blocks: list[int]) -> None:
    async def main() -> None:
        kv = [torch.randn(LAYOUT.tensor_shape(NUM_BLOCKS)).half() for _ in range(LAYOUT.num_layers)]
        async with Agent(AgentConfig(instance_id="prefill-0", role="prefill", nats_url=nats_url),
                         layout=LAYOUT, kv_caches=kv) as agent:
            # The router told us where the decode engine reserved blocks (kv_transfer_params).
            handle = await agent.push("req-1", "decode-0", src_blocks=[7, 3, 12, 40],
                                      dst_blocks=dst_blocks)
            for layer in range(LAYOUT.num_layers):
                await anyio.sleep(0.01)  # the model computing layer `layer`
                handle.layer_ready(layer)  # ... and its KV leaves now, not after the last layer
            result = await handle.wait()
            print(f"prefill: sent {result.bytes} bytes in {result.seconds * 1e3:.1f} ms")

    anyio.run(main)


async def decode(nats_url: str) -> None:
    kv = [torch.zeros(LAYOUT.tensor_shape(NUM_BLOCKS)).half() for _ in range(LAYOUT.num_layers)]
    async with Agent(AgentConfig(instance_id="decode-0", role="decode", nats_url=nats_url),
                     layout=LAYOUT, kv_caches=kv) as agent:
        blocks = [0, 1, 2, 3]  # what our block allocator handed this request
        handle = agent.expect("req-1", blocks, src="prefill-0")
        proc = mp.get_context("spawn").Process(target=prefill, args=(nats_url, blocks))
        proc.start()
        for layer in range(LAYOUT.num_layers):
            await handle.wait_layer(layer)  # attention for this layer could run now
            print(f"decode: layer {layer} landed")
        result = await handle.wait()
        print(f"decode: {result.status}, {result.bytes} bytes, stats {agent.statistics()}")
        await anyio.to_thread.run_sync(proc.join)


if __name__ == "__main__":
    with EmbeddedNats() as nats:
        anyio.run(decode, nats.url)
