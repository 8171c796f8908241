"""examples/custom_engine.py for real: a transformers Llama made at test time, prefill and
decode engines in separate processes, each with its own sidecar; greedy tokens must match."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import custom_engine as ce


def test_disaggregated_tokens_equal_colocated(nats_server):
    disaggregated, colocated = ce.run(nats_server.url)
    assert len(colocated) == ce.MAX_NEW
    assert len(set(colocated)) > 4, "the test model must not repeat one token"
    assert disaggregated == colocated


def test_the_comparison_can_fail():
    """Decoding from a wrong cache gives other tokens, so the equality above means something."""
    from transformers import DynamicCache

    model = ce.tiny_llama()
    prompt = ce.prompt_ids()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    first = int(out.logits[0, -1].argmax())
    wrong = DynamicCache(config=model.config)
    lay = ce.layout_of(model)
    for layer in range(lay.num_layers):
        k = cache.layers[layer].keys
        wrong.update(torch.zeros_like(k), cache.layers[layer].values, layer)  # keys lost
    assert ce.decode_steps(model, wrong, first, ce.MAX_NEW) != ce.colocated(prompt)
