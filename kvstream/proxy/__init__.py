"""``kvstream proxy``: an OpenAI-compatible prefill/decode proxy over the kvstream registry.

Each completion request runs in two legs, exactly as vLLM's toy P/D proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) does them, so engines
behind either proxy see the same thing:

* **P leg**: the client's body with ``kv_transfer_params`` asking for a remote decode,
  ``stream: false``, ``max_tokens: 1``; the prefill engine answers with the
  ``kv_transfer_params`` that name its held KV (engine id, request id, blocks).
* **D leg**: the client's body plus those params, streamed back as it arrives.

Both legs carry the same ``X-Request-Id``. Instances come from the registry (agents
announce their ``endpoint``) and from static URLs; the least loaded gets each leg
(``kvstream.routing.directory``). What the toy proxy does not do: when the D leg fails before the
decode engine could have pulled, the proxy tells the prefill instance to drop its offer
now (``release_offer``) instead of letting the blocks wait for the lease to expire.

**Decode-only** (``ProxyConfig.no_prefill="decode"``, the default): with no live prefill
instance, or when the P leg cannot reach its engine (it died between two registry
heartbeats), the request goes to a decode instance unchanged and without
``kv_transfer_params``, and that engine runs it whole (prompt included). Such responses
carry ``X-KVStream-Route: decode-only`` (P/D ones ``prefill-decode``); one WARNING marks
each change into this mode, ``ProxyStatistics.decode_only`` counts the requests.
``"reject"`` answers 503 instead.

Modules: ``config`` (settings, statistics, the legs' bodies), ``routing`` (which engine
gets a leg; pure bookkeeping), ``forwarding`` (the legs over HTTP) and ``server`` (the
HTTP server, ``Proxy``). aiohttp is the optional extra ``kvstream[proxy]``: only
``forwarding`` and ``server`` need it, so ``Proxy`` is imported from ``server`` when first
asked for, and ``routing`` and ``config`` import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream.proxy.config import PREFILL_PARAMS as PREFILL_PARAMS
from kvstream.proxy.config import ROUTE_HEADER as ROUTE_HEADER
from kvstream.proxy.config import NoPrefill as NoPrefill
from kvstream.proxy.config import ProxyConfig as ProxyConfig
from kvstream.proxy.config import ProxyStatistics as ProxyStatistics
from kvstream.proxy.config import decode_body as decode_body
from kvstream.proxy.config import decode_only_body as decode_only_body
from kvstream.proxy.config import prefill_body as prefill_body

if TYPE_CHECKING:
    from kvstream.proxy.server import Proxy as Proxy

__all__ = ["ROUTE_HEADER", "NoPrefill", "Proxy", "ProxyConfig", "ProxyStatistics", "decode_body",
           "decode_only_body", "prefill_body"]


def __getattr__(name: str) -> Any:
    if name == "Proxy":  # needs aiohttp; raises ConfigError without it
        from kvstream.proxy.server import Proxy

        return Proxy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
