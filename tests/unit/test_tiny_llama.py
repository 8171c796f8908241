"""The committed test transformer: the same bytes on every machine, and it does its job."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvstream.bench import tiny_llama
from kvstream.bench.tiny_llama import LAG, WEIGHTS, WEIGHTS_SHA256, copy_prompt

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[dev]' "
                    "(README command 2)")


def test_weights_are_the_pinned_file() -> None:
    assert hashlib.sha256(WEIGHTS.read_bytes()).hexdigest() == WEIGHTS_SHA256
    assert WEIGHTS.stat().st_size < 6 << 20  # float16: small enough to commit


def test_model_copies_from_lag_back() -> None:
    """Greedy decoding after a prompt of the copy language repeats the token LAG back:
    what makes "same tokens" checks of transferred KV meaningful."""
    model = tiny_llama.load_model()
    ids = copy_prompt(torch.Generator().manual_seed(7), 1, 96)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    new = out[0, 96:]
    want = torch.cat([ids[0], new])[96 - LAG:96 - LAG + 16]
    assert (new == want).float().mean() >= 0.9  # the language itself copies with p=0.9


def test_a_changed_file_is_refused(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "w.safetensors"
    data = bytearray(WEIGHTS.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(tiny_llama, "WEIGHTS", bad)
    with pytest.raises(tiny_llama.ConfigError, match="sha256"):
        tiny_llama.load_model()
