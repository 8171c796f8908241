"""A bounded pool of reusable host staging buffers.

Gathered sends and scattered receives go through here. The pool never holds
more than ``max_bytes``; a request waits (bounded) for room, and one larger
than the whole pool is refused at once. Freed buffers are kept for reuse, so a
steady stream of transfers does not touch the allocator (or page-fault fresh
memory) after the first few.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import ConfigError, TransferTimeout

if TYPE_CHECKING:
    import torch

__all__ = ["StagingPool"]


def _allocate(nbytes: int, device: str) -> torch.Tensor:
    """Host buffers come from numpy, which asks Linux for transparent huge pages on large
    allocations (torch does not): fewer page-table walks in every copy and far cheaper page
    pinning when UCX's cma transport reads or writes them."""
    import torch

    if device != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    import numpy as np

    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


class StagingPool:
    """Buffers live on ``device``: host memory, or the GPU when the KV cache is there."""

    def __init__(self, max_bytes: int, device: str = "cpu") -> None:
        if max_bytes <= 0:
            raise ConfigError(f"staging pool size must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.device = device
        self.in_use = 0
        self._cached: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> the whole buffer
        self._cached_bytes = 0
        self._changed = anyio.Event()
        self.peak = 0
        self.quarantined: list[torch.Tensor] = []

    async def acquire(self, nbytes: int, *, timeout: float) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes``; waits up to ``timeout`` for room."""

        if nbytes > self.max_bytes:
            raise ConfigError(
                f"a {nbytes}-byte layer does not fit the {self.max_bytes}-byte staging pool; "
                "raise AgentConfig.staging_bytes"
            )
        try:
            with anyio.fail_after(timeout):
                while self.in_use + nbytes > self.max_bytes:
                    await self._changed.wait()
        except TimeoutError:
            raise TransferTimeout(
                f"staging pool full ({self.in_use} of {self.max_bytes} bytes) for {timeout}s"
            ) from None
        return self._take(nbytes)

    def _take(self, nbytes: int, exact: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (``exact``: of exactly that many), charged whole."""
        for i, buf in enumerate(self._cached):
            if buf.numel() == nbytes or (not exact and buf.numel() > nbytes):
                self._cached.pop(i)
                self._cached_bytes -= buf.numel()
                break
        else:
            # Evict cached buffers that would push us over the cap, then allocate.
            while self._cached and self._cached_bytes + self.in_use + nbytes > self.max_bytes:
                self._cached_bytes -= self._cached.pop(0).numel()
            buf = _allocate(nbytes, self.device)
        self.in_use += buf.numel()
        self.peak = max(self.peak, self.in_use)
        self._lent[buf.data_ptr()] = buf
        return buf[:nbytes]

    def try_acquire_all(self, sizes: list[int]) -> list[torch.Tensor] | None:
        """All of ``sizes`` now, or nothing (for a push that must be staged whole). Charged
        exactly ``sum(sizes)`` (no larger cached buffer is reused): the caller bounds what
        pushes nobody reserved for may hold by those sizes, and a small push must not take
        a large buffer's worth of the pool."""
        if self.in_use + sum(sizes) > self.max_bytes:
            return None
        return [self._take(n, exact=True) for n in sizes]

    def quarantine(self, view: torch.Tensor) -> None:
        """Give the capacity back but never reuse (or free) the memory: a receive that could
        not be drained may still land in it."""
        buf = self._lent.pop(view.data_ptr())
        self.in_use -= buf.numel()
        self.quarantined.append(buf)
        self._changed.set()
        self._changed = anyio.Event()

    def release(self, view: torch.Tensor) -> None:
        buf = self._lent.pop(view.data_ptr())
        self.in_use -= buf.numel()
        if self.in_use + self._cached_bytes + buf.numel() <= self.max_bytes:
            self._cached.append(buf)
            self._cached_bytes += buf.numel()
        self._changed.set()
        self._changed = anyio.Event()

    def clear(self) -> None:
        self._cached.clear()
        self._cached_bytes = 0
