"""A tiny *trained* Llama made on this machine (CPU, ~20-35 s, no hub): the test
transformer of the codec accuracy report and of the vLLM tests.

Vocab 1000 (tokens "w0".."w999", word-level tokenizer), hidden 256, 4 layers, 8 heads,
2 KV heads, head_dim 32 (a head size vLLM's CPU attention supports), float32, tied
input/output embeddings, trained for 100 Adam steps on a synthetic "lag-32 copy"
language: token t repeats token t-32 with probability 0.9, else it is uniform on 3..999
(independently per position, so uniformly random prompts are in distribution).
Greedy decoding after any prompt of >= 33 tokens copies the prompt from 32 tokens back:
varied, decided by the cached KV (a head attends sharply to position t-32), and with real
argmax margins, so faithful KV gives the same tokens while wrong KV (another prompt's, a
misplaced block) changes them. Its sharp copy heads are also what makes KV precision
visible in attention, as a real model's induction heads do. A random init either repeats
one token forever (initializer_range 0.02) or, scaled up to avoid that, has logits so
wide (std ~64) that even a bfloat16 cache moves attention.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["LAG", "VOCAB", "cached_model", "copy_prompt", "make_model"]

VOCAB = 1000
LAG = 32


def copy_prompt(gen: Any, batch: int, seq: int, lag: int = LAG, eps: float = 0.1) -> Any:
    """Token ids of the copy language, ``[batch, seq]`` (``gen``: a torch.Generator)."""
    import torch

    x = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    keep = torch.rand(batch, seq, generator=gen) >= eps
    for t in range(lag, seq):  # left to right: a copy of a copy is a copy
        x[:, t] = torch.where(keep[:, t], x[:, t - lag], x[:, t])
    return x


def make_model(path: Path | str, seed: int = 0, steps: int = 100) -> Path:
    """Build, train and ``save_pretrained`` the model plus a WordLevel tokenizer into
    ``path`` (kept if already there). Needs transformers and tokenizers."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = copy_prompt(gen, batch=16, seq=96)
        logits = model(input_ids=x).logits[:, LAG - 1:-1]  # positions < LAG: unpredictable
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, LAG:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        warmup.step()
    model.eval().save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(path)
    return path


def cached_model(seed: int = 0, steps: int = 100) -> Path:
    """``make_model`` once per machine, kept under ``kvstream.quant.cpu.cache_dir()``/models.

    Processes starting together train it once (an exclusive lock on the models directory),
    and build in a private directory renamed into place, so none reads half a model; a
    build killed mid-way leaves a ``.build-*`` directory the next build sweeps. Where the
    cache is not writable the model is built in a temporary directory for this process.
    """
    import fcntl

    import torch
    import transformers

    from kvstream.quant.cpu import cache_dir

    # Keyed by this file and the libraries that train and save it: a changed recipe, or
    # another environment's transformers (vLLM pins its own), never loads the wrong model.
    recipe = hashlib.sha256(Path(__file__).read_bytes() + transformers.__version__.encode()
                            + torch.__version__.encode()).hexdigest()[:12]
    models = cache_dir() / "models"
    final = models / f"tiny-llama-copy{LAG}-s{seed}-n{steps}-{recipe}"
    if (final / "config.json").exists():
        return final
    try:
        models.mkdir(parents=True, exist_ok=True)
        lock = open(models / ".lock", "w")  # noqa: SIM115 (entered just below)
    except OSError:
        return make_model(Path(tempfile.mkdtemp(prefix="kvstream-tiny-llama-")) / "m", seed, steps)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists():  # built while we waited
            return final
        for stale in models.glob(".build-*"):  # only a dead builder leaves one (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=models, prefix=".build-"))
        try:
            make_model(tmp / "m", seed=seed, steps=steps)
            os.replace(tmp / "m", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    import sys
    import time

    t = time.time()
    print(make_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"),
          f"{time.time() - t:.1f}s")
