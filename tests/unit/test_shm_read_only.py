"""An exported KV segment is opened read-only by anyone who comes later: a same-user
process reaching it through ``/proc/<pid>/fd`` cannot write the engine's KV."""

from __future__ import annotations

import os

import numpy  # noqa: F401  - loaded before the fork: the child cannot read /root
import pytest
import torch  # noqa: F401

from kvstream.layout import KVLayout
from kvstream.shm import Segment, SharedKV, export, open_segment

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)


def _as_nobody() -> str:
    """Create, export and try to reopen a segment as an unprivileged user (root is not held
    back by file modes); the outcome as one word."""
    os.setgid(65534)
    os.setuid(65534)
    kv = SharedKV.create(LAYOUT, 4)
    spec = kv.spec
    seg = Segment(spec.fd, spec.inode, spec.size)
    before = open_segment(spec.pid, seg, writable=True)  # not exported yet: the sidecar's way
    os.close(before)
    assert export(kv.layers, 4) is not None
    ro = open_segment(spec.pid, seg, writable=False)
    os.close(ro)
    try:
        os.close(open_segment(spec.pid, seg, writable=True))
    except Exception as exc:  # LayoutError: "cannot open ...: Permission denied"
        if "Permission denied" not in str(exc):
            return f"other:{exc}"
    else:
        return "writable"
    kv.allow_attach()  # a sidecar's registration again
    os.close(open_segment(spec.pid, seg, writable=True))
    kv.layers[0][0].fill_(1)  # the owner's own mapping still writes
    return "read-only"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_an_exported_segment_reopens_read_only() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one word, never return into pytest
        try:
            word = _as_nobody()
        except BaseException as exc:
            word = f"error:{exc!r}"
        os.write(w, word.encode()[:512])
        os._exit(0)
    os.close(w)
    got = os.read(r, 512).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert got == "read-only"
