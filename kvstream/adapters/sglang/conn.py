"""kvstream as an SGLang disaggregation transfer backend (sglang 0.5.23's base classes).

SGLang builds these through its class lookup (``plugin.py``): ``manager.py`` (one agent
per scheduler process), ``sender.py`` (prefill), ``receiver.py`` (decode), ``side.py``
(their shared failure rule). SGLang's schedulers call them from their own thread, never
awaiting: every call is short (a table update, or one hop to the agent's loop), and
``poll()`` reads state the agent's loop wrote. The flow (``notes.py``): decode's
``send_metadata`` sends ``Want`` to each prefill rank it turns to; the prefill's ``poll``
says ``WaitingForInput`` once it has one (SGLang computes only then); the last ``send``
offers the pages and answers ``Ready`` with the aux row; the decode pulls (one rank, a
gather, or its share of a shared offer), and its ``poll`` writes the aux row (the room
last) once every page landed, then says ``Success``. The prefill's ``Success`` is the
offer's completion, so SGLang frees its pages only after the last byte left.

Failures are the backend's own: a kvstream transfer that fails, a peer the registry lost,
a ``Drop`` from the other side, a request waiting past SGLang's own timeouts: the poll
latches ``Failed``. ``abort()`` returns only once the request's stream stopped (SGLang
frees the pages when it returns). NATS is the bootstrap, so the bootstrap server is a
no-op.

Limits (``docs/architecture.md``, "SGLang backend"): the same page size on both sides,
no side state (FP8 block scales, SWA/Mamba state), no speculative draft KV, one
data-parallel rank and pipeline stage per engine.
"""

from kvstream.adapters.sglang.manager import (
    KVStreamBootstrapServer,
    KVStreamKVManager,
    instance_for,
)
from kvstream.adapters.sglang.receiver import KVStreamKVReceiver
from kvstream.adapters.sglang.sender import KVStreamKVSender

__all__ = ["KVStreamBootstrapServer", "KVStreamKVManager", "KVStreamKVReceiver",
           "KVStreamKVSender", "instance_for"]
