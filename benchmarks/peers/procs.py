"""The two processes of a peer benchmark, "prefill" and "decode", and their pipes.

Standard library only: ``nixl_peer.py`` (NIXL venv) and ``ucxx_peer.py`` (main venv)
both use it. Each side is a spawned process running ``target(role, conn, *args)``; it
answers every command with one dict, or ``{"error": ...}`` when it fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

__all__ = ["ROLES", "Pair"]

ROLES = ("prefill", "decode")


class Pair:
    """Spawns one process per role with a pipe each; subclasses say what they exchange."""

    system = "peer"  # names the processes in a timeout's message

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...],
                 timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.conns: dict[str, Any] = {}
        self.procs: list[Any] = []
        for role in ROLES:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(role, theirs, *args), daemon=True)
            proc.start()
            self.conns[role] = mine
            self.procs.append(proc)

    def recv(self, role: str) -> dict[str, Any]:
        conn = self.conns[role]
        if not conn.poll(self.timeout_s):
            raise RuntimeError(f"{self.system} {role} process did not answer in "
                               f"{self.timeout_s:.0f} s")
        msg: dict[str, Any] = conn.recv()
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def ask(self, role: str, **cmd: Any) -> dict[str, Any]:
        self.conns[role].send(cmd)
        return self.recv(role)

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.send({"op": "exit"})
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
