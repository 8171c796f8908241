"""KV-aware routing (issue 20): which instance holds which prefix, and where a request goes.

``index`` keeps each instance's prefix blocks from its KV events (pure), ``cost`` weighs a
request's overlap against load (pure), ``service`` runs a router on NATS (a queue group
serving ``Route``), ``client`` is what ``kvstream proxy`` asks it with.
"""
