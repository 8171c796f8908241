"""The proxy's rewrite of ``cached_tokens`` in a push's answer (``proxy/usage.py``): the
usage event found across any split of the stream, everything else byte for byte."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvstream.proxy.usage import SSEPatcher, patch_json, prefill_cached

USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 39}}
STREAM = (b'data: {"choices": [{"text": "a"}]}\n\n'
          b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b'}\n\n'
          b"data: [DONE]\n\n")


def _patched(cuts: list[int], cached: int | None) -> bytes:
    sse = SSEPatcher()
    out, last = [], 0
    for cut in [*sorted(cuts), len(STREAM)]:
        chunk = STREAM[last:cut]
        last = cut
        if sse.cached is None and sse.needs(chunk):
            sse.cached = cached
        out.append(sse.feed(chunk))
    out.append(sse.flush())
    return b"".join(out)


@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_the_usage_event_is_rewritten_wherever_the_stream_is_split(cuts):
    got = _patched(cuts, 7)
    events = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: {")]
    assert events[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    assert events[1]["usage"]["prompt_tokens"] == 40
    assert got.startswith(STREAM[:STREAM.index(b"\n\n") + 2]) and got.endswith(b"data: [DONE]\n\n")


def test_without_the_prefills_figure_the_stream_passes_unchanged():
    assert _patched([5, 60], None) == STREAM


def test_json_answers_and_the_prefills_params():
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    assert json.loads(patch_json(body, 3))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 3}
    no_details = json.dumps({"usage": {"prompt_tokens": 1}}).encode()
    assert patch_json(no_details, 3) == no_details and patch_json(b"{oops", 3) == b"{oops"
    assert prefill_cached({"remote_prefill_cached_tokens": 64}) == 64
    for bad in (None, {}, {"remote_prefill_cached_tokens": -1},
                {"remote_prefill_cached_tokens": True}, {"remote_prefill_cached_tokens": "9"}):
        assert prefill_cached(bad) is None
