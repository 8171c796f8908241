"""One meaning of ``usage.prompt_tokens_details.cached_tokens`` behind the proxy.

vLLM (0.32) reports, for a disaggregated request, the prompt tokens the *prefill* engine
found in its own prefix cache: the prefill returns them in its ``kv_transfer_params``
(``remote_prefill_cached_tokens``) and the decode engine reports that number instead of
its own hit rate, which would be the whole prompt (its KV came over the transfer). In a
pull the D leg carries the prefill's params, so that holds as it is. In a push the D leg
leaves before the prefill has answered, so the decode engine reports its own count; the
proxy writes the prefill's number into the decode's answer once the P leg has it. Pure
code: the relay (``forwarding.py``) feeds it the body.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["MAX_LINE", "SSEPatcher", "patch_json", "prefill_cached"]

MAX_LINE: Final = 1 << 20  # an SSE line longer than this passes through unread


def prefill_cached(params: dict[str, Any] | None) -> int | None:
    """The prefill engine's own cache hits from its ``kv_transfer_params``, if it said."""
    value = (params or {}).get("remote_prefill_cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _patch(obj: Any, cached: int) -> bool:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    details["cached_tokens"] = cached
    return True


def patch_json(body: bytes, cached: int) -> bytes:
    """A JSON completion with the prefill's count as ``cached_tokens`` (unchanged when it
    has no such field or is no JSON)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    return json.dumps(obj).encode() if _patch(obj, cached) else body


class SSEPatcher:
    """Server-sent events with the prefill's count in the usage event: ``feed`` chunks as
    they come, write what it returns; ``flush`` at the end. Events pass through at once
    (only whole lines are held, and SSE events end with a blank line)."""

    def __init__(self, cached: int | None = None) -> None:
        self.cached = cached  # None: events pass unchanged (set it once ``needs`` says so)
        self._rest = b""

    def needs(self, chunk: bytes) -> bool:
        """Whether ``chunk`` may complete the usage event (then set ``cached`` first)."""
        return b'"prompt_tokens_details"' in self._rest[-64:] + chunk

    def feed(self, chunk: bytes) -> bytes:
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        if len(self._rest) > MAX_LINE:  # no SSE line this long is a usage event
            out, self._rest = data, b""
            return out
        return b"".join(self._line(line) for line in data[:cut].splitlines(keepends=True))

    def flush(self) -> bytes:
        out, self._rest = self._rest, b""
        return self._line(out) if out else b""

    def _line(self, line: bytes) -> bytes:
        if self.cached is None or not line.startswith(b"data: {") or \
                b'"prompt_tokens_details"' not in line:
            return line
        end = len(line.rstrip(b"\r\n"))
        try:
            obj = json.loads(line[6:end])
        except ValueError:
            return line
        if not _patch(obj, self.cached):
            return line
        return b"data: " + json.dumps(obj).encode() + line[end:]
