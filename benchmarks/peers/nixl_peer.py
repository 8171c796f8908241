"""NVIDIA NIXL on kvstream bench's workload: one-sided READ and WRITE between two processes.

    .venv-nixl/bin/python benchmarks/peers/nixl_peer.py [--block-bytes 65536]
        [--blocks-per-layer 256] [--layers 32] [--contiguous] [--progress-thread off,on]

Runs in the NIXL venv (``benchmarks/peers/install-nixl.sh``). A parent process starts a
"prefill" process holding the source cache and a "decode" process holding the
destination cache (host memory, both registered with NIXL's UCX backend as one buffer
per layer) and passes each agent's metadata to the other over pipes. Each side preps one
descriptor list of every chunk of its cache (at registration, as vLLM's NIXL connector
does); a transfer is then ``make_prepped_xfer`` with the request's chunk indices,
``transfer`` and polling ``check_xfer_state``, all timed (``post_ms``: the time until
the last request was posted). Variants:

* ``read``: decode pulls every chunk in one request; timed on decode, from the request
  to its completion (the bytes are in place when READ completes).
* ``write``: prefill pushes every chunk in one request with a notification; timed from
  prefill's request to decode seeing the notification (decode knows the bytes are in
  place; ``initiator_gbps`` is prefill's own completion).
* ``read_per_layer`` / ``write_per_layer``: one request per layer, posted one after the
  other, then all polled.

Every run is verified (destination zeroed before, every block checked after). Each
progress-thread setting gets its own pair of processes (NIXL's agent setting). Prints
one JSON object; the processes end with ``os._exit`` (NIXL 1.5.1 segfaults at
interpreter exit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from procs import Pair
from workload import PLANES, Workload, add_workload_args, workload_from_args

VARIANTS = ("read", "write", "read_per_layer", "write_per_layer")
POLL_SLEEP_S = 50e-6  # the target waiting for notifications: prompt, without a spinning core


def _descs(w: Workload, bases: list[int]) -> Any:
    """(address, length, device) of every chunk of a cache, in ``chunk_index`` order."""
    import numpy as np

    per_layer = PLANES * w.cache_blocks
    out = np.zeros((w.layers * per_layer, 3), dtype=np.uint64)
    offsets = np.arange(per_layer, dtype=np.uint64) * np.uint64(w.chunk_bytes)
    for layer, base in enumerate(bases):
        out[layer * per_layer:(layer + 1) * per_layer, 0] = np.uint64(base) + offsets
    out[:, 1] = w.chunk_bytes
    return out


def _indices(w: Workload, ids: list[int], layer: int) -> Any:
    import numpy as np

    blocks = np.asarray(ids, dtype=np.int32)
    return np.concatenate([w.chunk_index(layer, p, 0) + blocks for p in range(PLANES)])


def _side(role: str, conn: Any, knobs: dict[str, Any], progress_thread: bool) -> None:
    """One process: its cache, its agent, then the parent's commands until "exit"."""
    try:
        _serve(role, conn, Workload(**knobs), progress_thread)
    except BaseException as exc:
        conn.send({"error": f"{role}: {type(exc).__name__}: {exc}"})
    sys.stdout.flush()
    os._exit(0)


def _serve(role: str, conn: Any, w: Workload, progress_thread: bool) -> None:
    import numpy as np
    import torch
    from _data import make_layers, verify
    from nixl._api import nixl_agent, nixl_agent_config

    torch.set_num_threads(1)
    layers = make_layers(w, fill=role == "prefill")
    agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=progress_thread,
                                               backends=["UCX"]))
    agent.register_memory(layers)
    bases = [t.data_ptr() for t in layers]
    conn.send({"meta": agent.get_agent_metadata(), "bases": bases})
    peer = conn.recv()
    peer_name = agent.add_remote_agent(peer["meta"])
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(w, bases), "DRAM")
    remote = agent.prep_xfer_dlist(peer_name, _descs(w, peer["bases"]), "DRAM")
    # Who reads or writes what: the initiator's local chunks pair with the peer's.
    mine, theirs = (w.src_ids, w.dst_ids) if role == "prefill" else (w.dst_ids, w.src_ids)
    conn.send({"ok": True})
    while True:
        cmd = conn.recv()
        op = cmd["op"]
        if op == "exit":
            return
        if op == "zero":
            for t in layers:
                t.zero_()
            conn.send({"ok": True})
        elif op == "verify":
            conn.send({"verified": verify(layers, w)})
        elif op == "xfer":
            t0 = time.monotonic()
            kind, tag = cmd["kind"], cmd["tag"].encode()
            groups = ([[layer] for layer in range(w.layers)] if cmd["per_layer"]
                      else [list(range(w.layers))])
            handles = []
            for i, group in enumerate(groups):
                li = np.concatenate([_indices(w, mine, layer) for layer in group])
                ri = np.concatenate([_indices(w, theirs, layer) for layer in group])
                h = agent.make_prepped_xfer(kind, local, li, remote, ri,
                                            notif_msg=tag + b"/%d" % i)
                if agent.transfer(h) == "ERR":
                    raise RuntimeError(f"NIXL {kind} could not be posted")
                handles.append(h)
            t_posted = time.monotonic()
            pending = list(handles)
            while pending:
                state = agent.check_xfer_state(pending[-1])
                if state == "ERR":
                    raise RuntimeError(f"NIXL {kind} failed")
                if state == "DONE":
                    pending.pop()
            t_done = time.monotonic()
            for h in handles:
                agent.release_xfer_handle(h)
            conn.send({"t0": t0, "t_posted": t_posted, "t_done": t_done})
        elif op == "notifs":  # wait for a WRITE's notifications: the bytes are in place
            want, got = cmd["count"], 0
            prefix = cmd["tag"].encode() + b"/"
            while got < want:
                for msgs in agent.get_new_notifs().values():
                    got += sum(1 for m in msgs if m.startswith(prefix))
                if got < want:
                    time.sleep(POLL_SLEEP_S)
            conn.send({"t": time.monotonic()})
        else:
            raise RuntimeError(f"unknown command {op!r}")


class _Pair(Pair):
    """The two processes for one progress-thread setting."""

    system = "NIXL"

    def __init__(self, w: Workload, progress_thread: bool, timeout_s: float) -> None:
        super().__init__(_side, (dataclasses.asdict(w), progress_thread), timeout_s)
        hello = {role: self.recv(role) for role in self.conns}
        self.conns["prefill"].send(hello["decode"])
        self.conns["decode"].send(hello["prefill"])
        for role in self.conns:
            self.recv(role)

    def run(self, variant: str, tag: str, w: Workload) -> dict[str, Any]:
        per_layer = variant.endswith("_per_layer")
        kind = "READ" if variant.startswith("read") else "WRITE"
        self.ask("decode", op="zero")
        initiator, target = ("decode", "prefill") if kind == "READ" else ("prefill", "decode")
        requests = w.layers if per_layer else 1
        # The target waits for the requests' notifications (and so drives its own UCX
        # worker without a progress thread): after a READ the source may free its blocks,
        # after a WRITE the destination knows its bytes are in place.
        self.conns[target].send({"op": "notifs", "tag": tag, "count": requests})
        x = self.ask(initiator, op="xfer", kind=kind, per_layer=per_layer, tag=tag)
        t_notified = self.recv(target)["t"]
        t_end = t_notified if kind == "WRITE" else x["t_done"]
        verified = bool(self.ask("decode", op="verify")["verified"])
        out = {"gbps": w.payload_bytes / (t_end - x["t0"]) / 1e9, "verified": verified,
               "requests": requests, "post_ms": (x["t_posted"] - x["t0"]) * 1e3}
        if kind == "WRITE":
            out["initiator_gbps"] = w.payload_bytes / (x["t_done"] - x["t0"]) / 1e9
        return out


def measure(w: Workload, progress_threads: list[bool], repeat: int,
            timeout_s: float) -> dict[str, Any]:
    import nixl

    out: dict[str, Any] = {"system": "nixl", "nixl_version": _version(),
                           "nixl_module": os.path.dirname(nixl.__file__),
                           "workload": w.describe(), "payload_bytes": w.payload_bytes,
                           "descriptors": w.descriptors, "settings": {}}
    for pt in progress_threads:
        pair = _Pair(w, pt, timeout_s)
        try:
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for v in VARIANTS:  # warm-up: connections, first-touch of the UCX paths
                pair.run(v, f"warm-{v}", w)
            for i in range(repeat):
                for v in VARIANTS:
                    runs[v].append(pair.run(v, f"run{i}-{v}", w))
        finally:
            pair.close()
        out["settings"]["progress_thread_" + ("on" if pt else "off")] = {
            v: {"gbps": round(max(r["gbps"] for r in rs), 3),
                "runs_gbps": [round(r["gbps"], 3) for r in rs],
                "verified": all(r["verified"] for r in rs),
                "requests": rs[0]["requests"],
                "post_ms": round(min(r["post_ms"] for r in rs), 2),
                **({"initiator_gbps": round(max(r["initiator_gbps"] for r in rs), 3)}
                   if "initiator_gbps" in rs[0] else {})}
            for v, rs in runs.items()}
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl-cu12", "nixl"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--progress-thread", default="off,on",
                    help="NIXL progress thread settings to measure, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per variant (best kept)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per step")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout
    w = workload_from_args(args)
    settings = {"on": True, "off": False}
    pts = [settings[s.strip()] for s in args.progress_thread.split(",") if s.strip()]
    print(json.dumps(measure(w, pts, args.repeat, args.timeout)), flush=True)
    os._exit(0)  # NIXL is imported here too (measure); skip the interpreter's teardown


if __name__ == "__main__":
    main()
