"""Reading what UCX itself wrote about the transports it chose. Pure text parsing.

Two sources, both written by UCX into its log (``UCX_LOG_FILE``):

* With ``UCX_PROTO_INFO=used`` (UCX 1.21+), a worker prints, when it is destroyed, one
  table per operation it performed (tagged send from host memory, rendezvous fetch
  into cuda memory, ...): each message-size range, the protocol chosen for it, the
  transport/device it ran on (``sysv/memory``, ``cma/memory``, ``tcp/lo``) and how
  many requests started that protocol. Sends that finish inline (UCX's eager-short
  fast path, a few dozen bytes) are not counted. A row with a count is a protocol
  that actually carried data, which is what the doctor reports.
* At ``UCX_LOG_LEVEL=info`` every new endpoint configuration is logged with its lanes,
  ``... cfg#0 tag(sysv/memory cma/memory) rma(...)``: the transports a tagged send on
  that endpoint may use, whatever the memory. The fallback when no table was printed.

Both formats seen so far are accepted: UCX 1.21 puts the count and the range in one
cell (``| 1   8K..inf | rendezvous ... | cma/memory |``); later versions give the count
its own column under a header row.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import msgspec

__all__ = [
    "DEVICE_TRANSPORTS",
    "KNOWN_TRANSPORTS",
    "SHM_TRANSPORTS",
    "ProtoRow",
    "ProtoTable",
    "UcxLog",
    "parse_log",
    "transports_in",
    "used_transports",
]

SHM_TRANSPORTS: Final = frozenset({"sysv", "posix", "cma", "knem", "xpmem"})
# Transports that move GPU memory without a bounce through TCP: CUDA copy and IPC,
# GPUDirect RDMA over InfiniBand/RoCE verbs, and the ROCm/oneAPI equivalents.
DEVICE_TRANSPORTS: Final = frozenset({
    "cuda_copy", "cuda_ipc", "gdr_copy", "rc", "rc_verbs", "rc_mlx5", "rc_x", "dc",
    "dc_mlx5", "dc_x", "rocm_copy", "rocm_ipc", "rocm_gdr", "ze_copy", "ze_ipc", "ze_gpu",
})
KNOWN_TRANSPORTS: Final = SHM_TRANSPORTS | DEVICE_TRANSPORTS | frozenset({
    "self", "tcp", "ud", "ud_verbs", "ud_mlx5", "ud_x", "srd", "gga", "gga_mlx5",
})

# "[1796123007.373216] [host:4753 :0]   rest"
_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*?:(\d+)\s*:\s*\d+\]\s?(.*)$")
_TL_DEV = re.compile(r"\b([a-z][a-z0-9_]*)/[A-Za-z0-9_.:\-]+")
_TAG_LANES = re.compile(r"(?<![\w])tag\(([^)]*)\)")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)B?$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
# Warnings that say nothing about this host: ucxx's futures pool refilling, ucxx's own
# UCX_* defaults reported as unused.
_QUIET = ("UCXX", "unused environment variable", "UCX_WARN_UNUSED_ENV_VARS")
_SAID = re.compile(r"\bUCX\s+(WARN|ERROR)\s+(.*)$")
_DEVICE_WORDS = re.compile(r"\b(cuda|cuda-managed|rocm|rocm-managed|ze-host|ze-device|ze-managed)\b")


class ProtoRow(msgspec.Struct, frozen=True, kw_only=True):
    count: int  # requests that started this protocol (0 when UCX printed no count)
    lo: int
    hi: int | None  # None: no upper bound ("inf")
    description: str
    transports: tuple[str, ...]

    def covers(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size <= self.hi)


class ProtoTable(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    title: str  # "ucp_context_0 intra-node cfg#0 | tagged message by ... from host memory"
    memory: str  # "host" or "device"
    rows: tuple[ProtoRow, ...]


class UcxLog(msgspec.Struct, frozen=True, kw_only=True):
    tables: tuple[ProtoTable, ...]
    tag_lanes: tuple[str, ...]  # from every endpoint configuration logged, in order
    warnings: tuple[str, ...]  # UCX's own WARN / ERROR lines


def transports_in(text: str) -> tuple[str, ...]:
    """Transport names of ``tl/device`` pairs in ``text``, first appearance first."""
    return _unique(m.group(1) for m in _TL_DEV.finditer(text))


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _size(text: str) -> int | None:
    if text == "inf":
        return None
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _row(cells: list[str]) -> ProtoRow | None:
    if len(cells) < 3:
        return None
    lead = " ".join(cells[:-2]).split()
    if not lead or lead[0].lower() in ("count", "range"):
        return None  # the header row of newer UCX versions
    count_text, range_text = (lead[0], lead[-1]) if len(lead) >= 2 else ("0", lead[0])
    lo_text, _, hi_text = range_text.partition("..")
    try:
        count = int(count_text)
        lo = _size(lo_text)
        hi = _size(hi_text) if hi_text else lo
    except ValueError:
        return None
    desc = cells[-2].removeprefix("(?)").strip()
    return ProtoRow(count=count, lo=lo or 0, hi=hi, description=desc,
                    transports=transports_in(cells[-1]))


class _Open:
    def __init__(self) -> None:
        self.borders = 0
        self.title: list[str] = []
        self.rows: list[ProtoRow] = []


def parse_log(text: str) -> UcxLog:
    """Tables, tag lanes and warnings from one or more UCX log files' text."""
    tables: list[ProtoTable] = []
    lanes: list[str] = []
    warnings: list[str] = []
    open_: dict[int, _Open] = {}

    def close(pid: int) -> None:
        t = open_.pop(pid)
        if t.rows:
            title = " | ".join(t.title)
            memory = "device" if _DEVICE_WORDS.search(title) else "host"
            tables.append(ProtoTable(pid=pid, title=title, memory=memory, rows=tuple(t.rows)))

    for line in text.splitlines():
        m = _PREFIX.match(line)
        if m is None:
            continue
        pid, rest = int(m.group(1)), m.group(2).strip()
        if rest.lstrip("| ").startswith("+"):  # a border, or a separator under merged cells
            t = open_.setdefault(pid, _Open())
            if t.rows:
                close(pid)
            else:
                t.borders += 1
        elif rest.startswith("|") and pid in open_:
            t = open_[pid]
            cells = [c.strip() for c in rest.strip("|").split("|")]
            if t.borders < 2:
                t.title.extend(c for c in cells if c)
            elif (row := _row(cells)) is not None:
                t.rows.append(row)
        else:
            if pid in open_:
                close(pid)
            found = _TAG_LANES.search(rest)
            if found and "cfg#" in rest:
                lanes.extend(transports_in(found.group(1)))
            elif (said := _SAID.search(rest)) and not any(q in rest for q in _QUIET):
                warnings.append(f"{said.group(1)} {said.group(2).strip()}")
    for pid in list(open_):
        close(pid)
    return UcxLog(tables=tuple(tables), tag_lanes=_unique(lanes), warnings=_unique(warnings))


def used_transports(log: UcxLog, memory: str, size: int | None = None) -> tuple[str, ...]:
    """Transports of the protocols that carried ``memory`` ("host"/"device") data, for
    messages of ``size`` bytes if given; in order of message size."""
    rows = [r for t in log.tables if t.memory == memory for r in t.rows
            if r.count > 0 and (size is None or r.covers(size))]
    rows.sort(key=lambda r: r.lo)
    return _unique(tl for r in rows for tl in r.transports)
