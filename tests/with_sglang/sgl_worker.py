"""One SGLang scheduler process's side of a P/D run, driven in SGLang's order against the
real kvstream backend classes (looked up through SGLang's own ``get_kv_class`` after its
``load_plugins``), on token-to-KV pools laid out as SGLang lays them out (per layer a K and
a V buffer of ``[size + page_size, heads, head_dim]``, K of every layer first) and SGLang's
own ``MetadataBuffers`` for the aux rows.

    python -m tests.with_sglang.sgl_worker {prefill,decode} SCENARIO PORT ROOMS OUT \
        [--rank R --tp T --mla --draft --model-dir DIR --state {mamba,swa,dsa}]

Page ``k`` of a room holds a pattern of (room, k) over the model's KV heads; a prefill
rank holds its heads of it (as SGLang splits them over TP), and a decode rank checks
every byte of its own heads of its pages and the aux row. The result (each room's last
poll, what was checked) is written to OUT as JSON. Scenarios: ``ok``, ``abort_decode``
(the decode aborts after its metadata, before the prefill sends), ``kill`` (the prefill
sleeps after its first room so the test can kill it; the decode's next room must fail
within the peer timeout), ``ask`` (a decode that asks for each room read from stdin,
for SGLang's own sender tests), ``late`` (a prefill rank above 0 builds its last
room's sender only once the decode has left: the Want it kept must still count). The
prefill's ``KVArgs`` carry its heads (as SGLang 0.5.23's prefill sets them); with
``--model-dir`` the decode gets a real ``ServerArgs`` for that model and no heads in its
``KVArgs`` (as SGLang 0.5.23's decode), so the backend reads them from SGLang's model
config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types

import numpy as np
import torch

LAYERS, HEADS, DIM, PAGE, SIZE = 3, 2, 16, 16, 32 * 16  # SIZE tokens of pool per layer
MLA_DIM = 24  # MLA's latent per token (one "head")
TOKENS = 70  # a partial last page: 5 pages


class Model:
    """The KV heads of this rank: MHA ``HEADS`` model-wide over TP, or MLA's one latent."""

    def __init__(self, rank: int, tp: int, mla: bool) -> None:
        from kvstream.transfer.ranks import heads

        self.mla = mla
        self.heads = range(1) if mla else heads(rank, tp, HEADS)
        self.dim = MLA_DIM if mla else DIM

    def pattern(self, room: int, k: int) -> torch.Tensor:
        """Page ``k`` of ``room``, this rank's heads of it."""
        gen = torch.Generator().manual_seed((room * 131 + k) % (1 << 62))
        full = torch.randn(PAGE, 1 if self.mla else HEADS, self.dim, generator=gen).half()
        return full[:, self.heads.start:self.heads.stop]

    def pools(self, draft: bool = False) -> list[torch.Tensor]:
        """SGLang's buffers: MHA K of every layer, then V; MLA one per layer; then a
        one-layer speculative draft's (its K, its V), as SGLang appends them."""
        n = (LAYERS if self.mla else 2 * LAYERS) + (2 if draft else 0)
        return [torch.zeros(SIZE + PAGE, len(self.heads), self.dim, dtype=torch.float16)
                for _ in range(n)]


SLOTS = 6  # Mamba state slots per layer buffer
SCALE = 16  # bytes of block scales per page
SWA_LAYERS, SWA_PAGES, WINDOW = 2, 9, 2  # the SWA sub-pool: its layers, pages, a window
DSA = 40  # bytes of an MLA model's indexer per page


class State:
    """Side state as SGLang lists it, one of three sets:

    * ``mamba``: a Mamba component (two conv and two temporal buffers of other item sizes,
      and a layer without state: no bytes), one slot per request, and block scales (K
      and V scales), one item per KV page: a rank's own bytes;
    * ``swa``: an MHA model's SWA sub-pool (K of each SWA layer, then V, pages like the
      main pool's: this rank's heads of them), the request's window of its own pages;
    * ``dsa``: an MLA model's indexer pages (the KV pages' ids), the same on every rank.
    """

    def __init__(self, name: str, model: Model) -> None:
        self.name, self.model = name, model
        if name == "mamba":
            self.kinds = ("mamba", "block_scale")
            self.bufs = [[torch.zeros(SLOTS, n, dtype=torch.uint8) for n in (48, 48, 80, 80)],
                         [torch.zeros(SIZE // PAGE + 1, SCALE, dtype=torch.uint8)
                          for _ in range(2)]]
        elif name == "swa":
            self.kinds = ("swa",)
            self.bufs = [[torch.zeros(SWA_PAGES * PAGE, len(model.heads), DIM,
                                      dtype=torch.float16) for _ in range(2 * SWA_LAYERS)]]
        elif name == "dsa":
            self.kinds = ("dsa",)
            self.bufs = [[torch.zeros(SIZE // PAGE + 1, DSA, dtype=torch.uint8)
                          for _ in range(LAYERS)]]
        else:
            raise ValueError(name)

    def _items(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer as its items (an SWA buffer's: pages)."""
        return t.view(-1, PAGE, *t.shape[1:]) if self.name == "swa" else t

    def fill(self, args: object) -> None:
        from sglang.srt.disaggregation.base.conn import StateType

        args.state_types = [StateType(k) for k in self.kinds]
        args.state_data_ptrs = [[t.data_ptr() for t in c] for c in self.bufs]
        args.state_data_lens = [[t.nbytes for t in c] for c in self.bufs]
        args.state_item_lens = [[self._items(t)[0].nbytes for t in c] for c in self.bufs]
        if self.name == "mamba":
            args.state_data_ptrs[0].insert(2, 0)  # a layer without Mamba state
            args.state_data_lens[0].insert(2, 0)
            args.state_item_lens[0].insert(2, 0)
        if self.name == "swa":
            args.swa_kv_cache_layout = "nhd"

    def request(self, role: str, i: int, slot: int, pages: list[int]) -> list[list[int]]:
        """The indices of request ``i`` per component (each side its own)."""
        if self.name == "mamba":
            return [[slot], pages]
        if self.name == "swa":  # the last WINDOW pages, in the SWA pool's own page ids
            first = 1 + i if role == "prefill" else SWA_PAGES - 1 - i
            step = 2 if role == "prefill" else -2
            return [[first + step * k for k in range(WINDOW)]]
        return [pages]

    def indices(self, idx: list[list[int]]) -> list[object]:
        """As SGLang passes them: a Mamba slot wrapped in a list, pages as arrays."""
        if self.name == "mamba":
            return [[np.array(idx[0][0], dtype=np.int64)], np.array(idx[1], dtype=np.int32)]
        return [np.array(x, dtype=np.int32) for x in idx]

    def item(self, room: int, comp: int, buf: int, k: int, like: torch.Tensor) -> torch.Tensor:
        """Item ``k`` of the request's component ``comp`` in buffer ``buf``: this rank's
        heads of an SWA page, the whole item otherwise."""
        gen = torch.Generator().manual_seed((room * 977 + comp * 31 + buf * 7 + k) % (1 << 62))
        if self.name == "swa":
            full = torch.randn(PAGE, HEADS, DIM, generator=gen).half()
            return full[:, self.model.heads.start:self.model.heads.stop]
        return torch.randint(0, 256, like.shape, generator=gen, dtype=torch.uint8)

    def write_as(self, room: int, idx: list[list[int]], rank: int) -> None:
        """What prefill rank ``rank`` holds: the items, or for an MLA model's replicated
        state on a rank the decode does not read (above 0), other bytes, so the decode's
        check proves which rank it read."""
        self.write(room, idx)
        if self.name == "dsa" and rank > 0:
            for comp, ids in enumerate(idx):
                for t in self.bufs[comp]:
                    for i in ids:
                        t[i] ^= 0xFF

    def stray(self, used: set[tuple[int, int]]) -> bool:
        """Whether any item outside ``used`` (component, index) pairs holds a byte."""
        return any(bool(self._items(t)[i].any()) for comp, c in enumerate(self.bufs)
                   for t in c for i in range(self._items(t).shape[0])
                   if (comp, i) not in used)

    def write(self, room: int, idx: list[list[int]]) -> None:
        for comp, ids in enumerate(idx):
            for b, t in enumerate(self.bufs[comp]):
                items = self._items(t)
                for k, i in enumerate(ids):
                    items[i] = self.item(room, comp, b, k, items[i])

    def exact(self, room: int, idx: list[list[int]]) -> bool:
        return all(torch.equal(self._items(t)[i], self.item(room, comp, b, k,
                                                            self._items(t)[i]))
                   for comp, ids in enumerate(idx)
                   for b, t in enumerate(self.bufs[comp]) for k, i in enumerate(ids))


def kv_args(role: str, bufs: list[torch.Tensor], meta: object, rank: int,
            model: Model, heads_told: bool) -> object:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    args = get_kv_class(TransferBackend("kvstream"), KVClassType.KVARGS)()
    args.engine_rank = rank
    args.pp_rank = 0
    args.kv_data_ptrs = [t.data_ptr() for t in bufs]
    args.kv_data_lens = [t.nbytes for t in bufs]
    args.kv_item_lens = [t[0].nbytes * PAGE for t in bufs]
    args.num_draft_entries = len(bufs) - (LAYERS if model.mla else 2 * LAYERS)
    args.kv_layer_ids = []
    args.page_size = PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.state_types = []
    args.ib_device = None
    args.gpu_id = 0
    args.kv_cache_dtype_str = "auto"
    if heads_told and not model.mla:
        args.kv_head_num = len(model.heads)
        args.total_kv_head_num = HEADS
    if role == "prefill":
        args.prefill_start_layer = 0
    return args


def until(fn, states: set[int], timeout: float = 60.0) -> int:
    end = time.monotonic() + timeout
    while True:
        s = int(fn())
        if s in states or time.monotonic() > end:
            return s
        time.sleep(0.01)


def server_args(role: str, tp: int, port: int, model_dir: str | None) -> object:
    if model_dir is None:
        return types.SimpleNamespace(tp_size=tp, device="cpu", host="127.0.0.1",
                                     disaggregation_bootstrap_port=port)
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=model_dir, device="cpu", tp_size=tp, host="127.0.0.1",
                      disaggregation_bootstrap_port=port, skip_tokenizer_init=True,
                      disaggregation_mode=role)


def main() -> None:
    cli = argparse.ArgumentParser()
    for name in ("role", "scenario", "port", "rooms", "out"):
        cli.add_argument(name)
    cli.add_argument("--rank", type=int, default=0)
    cli.add_argument("--tp", type=int, default=1)
    cli.add_argument("--mla", action="store_true")
    cli.add_argument("--draft", action="store_true")
    cli.add_argument("--model-dir")
    cli.add_argument("--state", default="", help="side state: mamba, swa or dsa")
    a = cli.parse_args()
    role, scenario, port, out = a.role, a.scenario, int(a.port), a.out
    rooms = [int(r) for r in a.rooms.split(",")]
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.mem_cache.common import kv_to_page_indices

    backend = TransferBackend("kvstream")
    model = Model(a.rank, a.tp, a.mla)
    bufs = model.pools(a.draft)
    meta = MetadataBuffers(64, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=16)
    args = kv_args(role, bufs, meta, a.rank, model,
                   heads_told=role == "prefill" or a.model_dir is None)
    state = State(a.state, model) if a.state else None
    if state is not None:
        state.fill(args)
    sargs = server_args(role, a.tp, port, a.model_dir if role == "decode" else None)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sargs, a.mla)
    addr = f"127.0.0.1:{port}"
    report: dict[str, object] = {"classes": [type(mgr).__module__ + "." + type(mgr).__name__],
                                 "heads": [mgr.agent.memory.layout.num_kv_heads,
                                           mgr.total_kv_heads]}
    polls: dict[str, object] = {}
    npages = -(-TOKENS // PAGE)
    if role == "prefill":
        cls = get_kv_class(backend, KVClassType.SENDER)
        for i, room in enumerate(rooms):
            if scenario == "late" and a.rank > 0 and i == len(rooms) - 1:
                report["decode_left"] = until(lambda: not mgr.rt.call(
                    mgr.agent.registry.instances, "decode"), {True}, timeout=60)
            sender = cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room,
                         dest_tp_ranks=[a.rank], pp_rank=0)
            first = until(sender.poll, {KVPoll.WaitingForInput, KVPoll.Failed})
            if first == KVPoll.Failed:
                polls[str(room)] = ["bootstrap", int(first)]
                try:
                    sender.failure_exception()
                except Exception as exc:  # SGLang logs it
                    polls[str(room)].append(str(exc))
                continue
            aux_index = 3 + i
            sender.init(npages, aux_index)
            # Its pages: any free ones of the pool (SGLang's allocator), page 0 is padding.
            page_ids = [7 + 2 * j + i for j in range(npages)]
            for j, p in enumerate(page_ids):
                for t in bufs:
                    t[p * PAGE:(p + 1) * PAGE] = model.pattern(room, j)
            meta.output_ids[aux_index, 0] = room % 1000
            meta.cached_tokens[aux_index, 0] = 11
            meta.bootstrap_room[aux_index, 0] = room  # set_buf writes the room last
            token_ids = torch.tensor([p * PAGE + t for p in page_ids for t in range(PAGE)]
                                     )[:TOKENS]
            pages = kv_to_page_indices(token_ids, PAGE).astype(np.int32)
            assert list(pages) == page_ids
            last_state: object = []
            if state is not None:  # with the last chunk, as SGLang passes it
                idx = state.request(role, i, 1 + i, page_ids)
                state.write_as(room, idx, a.rank)
                last_state = state.indices(idx)
            if sender.should_send_kv_chunk(2, False):
                sender.send(pages[:2], None, num_kv_tokens=2 * PAGE)
            assert sender.should_send_kv_chunk(len(pages) - 2, True)
            sender.send(pages[2:], last_state, num_kv_tokens=TOKENS - 2 * PAGE)
            final = until(sender.poll, {KVPoll.Success, KVPoll.Failed})
            metric = sender.get_transfer_metric()
            polls[str(room)] = [int(first), int(final), metric.transfer_total_bytes]
            if final == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as exc:  # SGLang logs it
                    polls[str(room)].append(str(exc))
            sender.clear()
            if scenario == "kill" and i == 0:
                report["polls"] = polls
                with open(out, "w") as f:
                    json.dump(report, f)
                time.sleep(600)  # the test kills this process here
    else:
        cls = get_kv_class(backend, KVClassType.RECEIVER)
        end = time.monotonic() + 30
        while not mgr.try_ensure_parallel_info(addr) and time.monotonic() < end:
            time.sleep(0.1)
        if scenario == "ask":  # for SGLang's own sender tests: ask for each room read
            print("ready", flush=True)
            held = []
            for line in sys.stdin:
                rx = cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=int(line))
                rx.init(0)
                rx.send_metadata(np.array([1, 2, 3], dtype=np.int32), 1, None)
                held.append(rx)
            mgr.teardown()
            return
        used: set[tuple[int, int]] = set()  # the side state items the rooms were given
        for i, room in enumerate(rooms):
            rx = cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            assert int(rx.poll()) == KVPoll.Bootstrapping
            rx.init(0)
            if int(rx.poll()) == KVPoll.Failed:  # refused: the pair cannot move this KV
                try:
                    rx.failure_exception()
                except Exception as exc:
                    polls[str(room)] = [int(KVPoll.Failed), False, [], 0.0, str(exc)]
                rx.clear()
                continue
            assert int(rx.poll()) == KVPoll.WaitingForInput
            aux_index = 10 + i
            page_ids = [20 + 2 * j + i for j in range(npages)]
            idx = state.request(role, i, SLOTS - 1 - i, page_ids) if state else []
            used.update((c, x) for c, ids in enumerate(idx) for x in ids)
            rx.send_metadata(np.array(page_ids, dtype=np.int32), aux_index,
                             state.indices(idx) if state is not None else None,
                             decode_prefix_len=0)
            t0 = time.monotonic()
            if scenario == "abort_decode":
                rx.abort()
                final = int(rx.poll())
                untouched = all(not t[p * PAGE:(p + 1) * PAGE].any()
                                for p in page_ids for t in bufs)
                polls[str(room)] = [final, untouched]
                rx.clear()
                continue
            final = until(rx.poll, {KVPoll.Success, KVPoll.Failed}, timeout=90)
            took = time.monotonic() - t0
            exact = final == KVPoll.Success and all(
                torch.equal(t[p * PAGE:(p + 1) * PAGE], model.pattern(room, j))
                for j, p in enumerate(page_ids) for t in bufs)
            aux = [int(meta.output_ids[aux_index, 0]), int(meta.cached_tokens[aux_index, 0]),
                   int(meta.bootstrap_room[aux_index, 0])]
            polls[str(room)] = [final, exact, aux, round(took, 2)]
            if state is not None:
                report.setdefault("state", {})[str(room)] = state.exact(room, idx)
            if final == KVPoll.Failed:
                try:
                    rx.failure_exception()
                except Exception as exc:
                    polls[str(room)].append(str(exc))
            rx.clear()
        if state is not None:
            report["stray"] = state.stray(used)
    report["polls"] = polls
    with open(out, "w") as f:
        json.dump(report, f)
    if role == "decode":
        # The scenarios' premise (a real decode server lives on): the prefill ranks knew
        # this decode (a heartbeat of it reached each) before it left. One that exits
        # within its first moments (it refused at once, or read only rank 0) may have
        # been heard by none of the ranks it did not read: their kept notes wait for an
        # announcement that never comes.
        time.sleep(2 * mgr.agent.config.heartbeat_s)
    mgr.teardown()


if __name__ == "__main__":
    main()
