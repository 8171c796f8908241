"""Registered KV memory: the engine's per-layer tensors, checked against a KVLayout.

Every block id that arrives from outside is checked here before any byte
moves. Blocks are moved as *planes*: a layer tensor is viewed as
``[chunks_per_block, num_blocks, chunk]`` so a block is one row per plane; the
wire carries, per plane, the mapped blocks' rows in manifest order. A plane
whose block ids are consecutive is one contiguous run and moves without a copy;
otherwise it is gathered into / scattered out of a staging buffer with
``index_select`` / ``index_copy_`` on the widest integer dtype the chunk allows
(uint8 ``index_copy_`` is 6x slower than int64 in torch on CPU).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from kvstream._exceptions import InvalidBlockError, LayoutError
from kvstream.layout import FP8_DTYPES, KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["BlockMap", "RegisteredKV", "fenced", "is_run", "run_copy"]


def _elem_dtype(chunk_bytes: int) -> torch.dtype:
    import torch

    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if chunk_bytes % size == 0:
            return dt
    return torch.uint8


def is_run(ids: Sequence[int]) -> bool:
    """True when ``ids`` are consecutive ascending block ids (one contiguous run per plane)."""
    return bool(ids) and list(ids) == list(range(ids[0], ids[0] + len(ids)))


_copier: concurrent.futures.ThreadPoolExecutor | None = None


def _single_threaded() -> None:
    import torch

    torch.set_num_threads(1)


def _cuda_devices(args: tuple[Any, ...]) -> set[Any]:
    """The CUDA devices of the tensors among ``args`` (and of a ``BlockMap``'s index)."""
    import torch

    found = set()
    for a in args:
        if isinstance(a, BlockMap):
            if a.device.type == "cuda":
                found.add(a.device)
        elif isinstance(a, torch.Tensor) and a.is_cuda:
            found.add(a.device)
    return found


def fenced(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``, then wait (on this thread) until every device copy it queued is done.

    torch queues a device copy and returns at once; UCX copies device memory on its own
    streams and ucxx never synchronizes, and a staging slot is reused as soon as its copy
    returns. So a copy is fenced: an event recorded after it on the stream it ran on (the
    device's current stream of this thread), waited before anything touches the buffer."""
    fn(*args)
    devices = _cuda_devices(args)
    if devices:
        import torch

        for dev in devices:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(dev))
            done.synchronize()


async def run_copy(fn: Callable[..., None], *args: Any) -> None:
    """Run a gather/scatter on kvstream's own copy threads and wait for it, device work
    included (``fenced``; not cancellable midway: the buffers are in use until it returns).

    The threads run torch single-threaded: its intra-op threads spin after every parallel
    region, and with prefill, cma and scatter copies already filling the cores they only
    steal CPU (bench with agents in sidecars: 3.0 -> 3.7 GB/s). The setting is per thread,
    so an engine in the same process keeps its own.
    """
    global _copier
    if _copier is None:
        _copier = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvstream-copy", initializer=_single_threaded)
    future = asyncio.get_running_loop().run_in_executor(_copier, fenced, fn, *args)
    with anyio.CancelScope(shield=True):
        await future


def _check_scales(layout: KVLayout, scales: Sequence[float] | None) -> list[float]:
    """An FP8 cache's (k_scale, v_scale) per layer, or one pair for all layers."""
    if scales is None:
        return []
    values = [float(x) for x in scales]
    if layout.dtype not in FP8_DTYPES:
        raise LayoutError(f"cache_scales belong to an FP8 cache, not {layout.dtype}")
    if len(values) == 2:
        values = values * layout.num_layers
    if len(values) != 2 * layout.num_layers or not all(0 < x < float("inf") for x in values):
        raise LayoutError(f"cache_scales: one positive (k, v) pair per layer "
                          f"({2 * layout.num_layers} values) or one pair for all")
    return values


class BlockMap:
    """Validated block ids of one side of a transfer, with the index tensor prepared once."""

    def __init__(self, ids: Sequence[int], device: torch.device) -> None:
        self.ids = list(ids)
        self.device = device
        self.contiguous_start: int | None = self.ids[0] if is_run(self.ids) else None
        self._index: torch.Tensor | None = None

    @property
    def index(self) -> torch.Tensor:
        """The ids as a tensor on the memory's device, made on first use: by a copy thread,
        never the event loop (a host-to-device copy waits behind the device's queue)."""
        if self._index is None:
            import torch

            self._index = torch.tensor(self.ids, dtype=torch.int64, device=self.device)
        return self._index

    def __len__(self) -> int:
        return len(self.ids)

    def without(self, skip: Sequence[int]) -> BlockMap:
        """The same map minus the positions in ``skip`` (blocks the destination holds)."""
        if not skip:
            return self
        drop = set(skip)
        return BlockMap([b for i, b in enumerate(self.ids) if i not in drop], self.device)


class RegisteredKV:
    """An engine's KV cache tensors (one per layer; a split layout's K of every layer,
    then its V), validated once at registration."""

    def __init__(self, layout: KVLayout, layers: Sequence[torch.Tensor], *,
                 cache_scales: Sequence[float] | None = None) -> None:
        import torch

        per = layout.tensors_per_layer
        if len(layers) != layout.num_layers * per:
            raise LayoutError(f"layout has {layout.num_layers} layers, got {len(layers)} tensors"
                              + (" (a split layout registers K of every layer, then V)"
                                 if per == 2 else ""))
        want_dtype = getattr(torch, layout.dtype)
        first = layers[0]
        num_blocks = layout.num_blocks_of(tuple(first.shape))
        want_shape = layout.tensor_shape(num_blocks)
        if num_blocks < 1:
            raise LayoutError(f"layer 0: shape {tuple(first.shape)} holds no whole block "
                              f"({layout.describe()})")
        for i, t in enumerate(layers):
            if tuple(t.shape) != want_shape:
                raise LayoutError(
                    f"layer {i}: shape {tuple(t.shape)} does not match {layout.arrangement} "
                    f"{want_shape} ({layout.describe()})"
                )
            if t.dtype != want_dtype:
                raise LayoutError(f"layer {i}: dtype {t.dtype} but the layout says {layout.dtype}")
            if not t.is_contiguous():
                raise LayoutError(f"layer {i}: tensor is not contiguous")
            if t.device != first.device:
                raise LayoutError(f"layer {i}: on {t.device}, layer 0 on {first.device}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                       for i, t in enumerate(layers))
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:  # one received block would land in two places
                raise LayoutError(f"tensors {min(a, b)} and {max(a, b)} share memory: every "
                                  "layer (a split layout: every K and V) needs its own")
        self.layout = layout
        self.cache_scales = _check_scales(layout, cache_scales)
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.device = first.device
        self._elem = _elem_dtype(layout.chunk_bytes)
        elem_size = torch.empty(0, dtype=self._elem).element_size()
        self._row = layout.chunk_bytes // elem_size
        # Per layer, its planes as [num_blocks, row] (a split layout's from two tensors).
        self._planes: list[Sequence[torch.Tensor] | torch.Tensor] = [
            [self._flat(t).view(num_blocks, self._row) for t in self.layer_tensors(i)]
            if layout.split else
            self._flat(self.layers[i]).view(layout.chunks_per_block, num_blocks, self._row)
            for i in range(layout.num_layers)
        ]

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes as one row of the copy dtype (flat first: a last dimension
        of, say, 12 FP8 values cannot be viewed as 8-byte words, the whole tensor can)."""
        import torch

        return t.view(-1).view(torch.uint8).view(self._elem)

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The tensors holding one layer: its one cache tensor, or a split layout's K, V."""
        if self.layout.split:
            return self.layers[layer], self.layers[self.layout.num_layers + layer]
        return (self.layers[layer],)

    @property
    def planes(self) -> int:
        return self.layout.chunks_per_block

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes * self.layout.num_layers

    def block_map(self, ids: Sequence[int], *, what: str = "block") -> BlockMap:
        """Validate ids against this memory; raises ``InvalidBlockError`` naming the bad ones."""
        if not ids:
            raise InvalidBlockError(f"empty {what} list")
        bad = [b for b in ids if not isinstance(b, int) or b < 0 or b >= self.num_blocks]
        if bad:
            raise InvalidBlockError(
                f"{what} ids {bad[:8]}{'...' if len(bad) > 8 else ''} outside registered memory "
                f"of {self.num_blocks} blocks",
                block_ids=bad, limit=self.num_blocks,
            )
        if len(set(ids)) != len(ids):
            raise InvalidBlockError(f"duplicate {what} ids", block_ids=ids, limit=self.num_blocks)
        return BlockMap(ids, self.device)

    def plane_bytes(self, nblocks: int) -> int:
        return nblocks * self.layout.chunk_bytes

    def direct_run(self, layer: int, plane: int, blocks: BlockMap) -> torch.Tensor | None:
        """The engine memory of this plane's blocks when they are one contiguous run."""
        if blocks.contiguous_start is None:
            return None
        start = blocks.contiguous_start
        return self._planes[layer][plane][start:start + len(blocks)]

    def staging_view(self, staging: torch.Tensor, nblocks: int) -> torch.Tensor:
        """View a flat uint8 staging buffer as ``[planes, nblocks, row]`` of the copy dtype."""
        need = self.planes * self.plane_bytes(nblocks)
        return staging[:need].view(self._elem).view(self.planes, nblocks, self._row)

    def gather(self, layer: int, blocks: BlockMap, out: torch.Tensor) -> None:
        """Copy the layer's blocks, in map order, into ``out`` (a staging_view)."""
        import torch

        src = self._planes[layer]
        for p in range(self.planes):
            torch.index_select(src[p], 0, blocks.index, out=out[p])

    def scatter(self, layer: int, blocks: BlockMap, src: torch.Tensor) -> None:
        """Copy ``src`` (a staging_view, map order) into the layer's blocks."""
        dst = self._planes[layer]
        for p in range(self.planes):
            dst[p].index_copy_(0, blocks.index, src[p])

    def rows(self, layer: int, blocks: BlockMap) -> list[Any]:
        """The layer's blocks in wire order as uncopied numpy views, consecutive blocks
        merged into one view (what a vectored send reads, or a vectored receive fills)."""
        out: list[Any] = []
        ids = blocks.ids
        for p in range(self.planes):
            plane = self._planes[layer][p].numpy()
            start = prev = ids[0]
            for b in ids[1:]:
                if b != prev + 1:
                    out.append(plane[start:prev + 1])
                    start = b
                prev = b
            out.append(plane[start:prev + 1])
        return out

    def read_block(self, layer: int, block: int) -> torch.Tensor:
        """One block's bytes in wire order (tests and verification)."""
        import torch

        return torch.cat([self._planes[layer][p][block].view(torch.uint8)
                          for p in range(self.planes)])
