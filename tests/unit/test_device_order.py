"""The ordering rule for device memory, on the CPU: every copy kvstream queues is fenced (an
event recorded after it on the stream it ran on, waited before the copy returns, so before
UCX, a peer or a slot reuse touches the buffer); and both ends of a transfer frame a layer
alike whatever each one's device."""

from __future__ import annotations

import pytest
import torch

import kvstream.memory as memory
from kvstream.config import AgentConfig
from kvstream.control import messages as m
from kvstream.control.registry import Registry
from kvstream.dataplane.staging import StagingPool
from kvstream.dataplane.stream import single_message_for
from kvstream.engine.core import Core
from kvstream.memory import RegisteredKV, fenced
from tests.fakes import cache, small_layout


def test_a_copy_returns_only_once_its_device_work_is_done(monkeypatch):
    said: list[str] = []
    gpu = torch.device("cuda", 3)  # a device object needs no GPU

    class Event:
        def record(self, stream) -> None:
            said.append(f"record on {stream}")

        def synchronize(self) -> None:
            said.append("synchronize")

    monkeypatch.setattr(memory, "_cuda_devices", lambda args: {gpu})
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev: f"stream of cuda:{dev.index}")
    fenced(lambda *a: said.append(f"copy {a}"), 1, 2)
    assert said == ["copy (1, 2)", "record on stream of cuda:3", "synchronize"]


def test_host_copies_need_no_fence():
    done = []
    fenced(lambda t: done.append(t.sum().item()), torch.ones(4))
    assert done == [4.0] and memory._cuda_devices((torch.ones(1), 7, "x")) == set()


def test_a_block_map_builds_its_index_where_it_is_used():
    mem = RegisteredKV(small_layout(), cache(small_layout(), 8, fill=False))
    blocks = mem.block_map([5, 1, 2])
    assert blocks._index is None  # not on the event loop that validated it
    assert blocks.index.tolist() == [5, 1, 2] and blocks.without([0]).ids == [1, 2]


def test_both_ends_frame_alike_whatever_their_devices():
    """One message per layer needs both ends' KV in host memory: a CPU end facing a GPU
    peer frames per plane, as the GPU end does (they disagreed before: truncation)."""
    mem = RegisteredKV(small_layout(), cache(small_layout(), 8, fill=False))
    assert single_message_for(mem, False, False, "none", "ucx", peer_on_cpu=True)
    assert not single_message_for(mem, False, False, "none", "ucx", peer_on_cpu=False)
    assert single_message_for(mem, False, False, "none", "tcp", peer_on_cpu=False)  # a stream

    registry = Registry(peer_timeout_s=2.0)
    core = Core(AgentConfig(instance_id="me"), registry=registry, staging=StagingPool(1 << 20),
                clock=lambda: 0.0)
    for iid, device in (("gpu-peer", "cuda"), ("cpu-peer", "cpu"), ("old-peer", "")):
        registry.observe(m.Announce(instance_id=iid, role="prefill", worker_address=b"a",
                                    kv_device=device))
    assert [core.peer_on_cpu(p) for p in ("gpu-peer", "cpu-peer", "old-peer", "unknown")] == \
        [False, True, True, True]


@pytest.mark.parametrize("arrangement", ["hnd_kv", "nhd_kv"])
def test_vllm_gpu_arrangements_read_k_then_v_per_token(arrangement):
    """vLLM 0.32's GPU layouts keep each token's K then V: kvstream's view of them."""
    from kvstream.layout import KVLayout
    from kvstream.transfer.plan import token_view

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=3,
                   arrangement=arrangement)
    t = torch.arange(2 * 2 * 3 * 8, dtype=torch.float16).view(lay.tensor_shape(2))
    kv = token_view(t, lay)  # [kv, nb, bs, h, d]
    for b, n, h in ((1, 2, 0), (0, 1, 1)):
        row = t[b, h, n] if arrangement == "hnd_kv" else t[b, n, h]
        assert torch.equal(kv[0, b, n, h], row[:4]) and torch.equal(kv[1, b, n, h], row[4:])
