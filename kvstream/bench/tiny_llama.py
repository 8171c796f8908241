"""A tiny *trained* Llama, committed as test data: the test transformer of the codec
accuracy report and of the vLLM tests.

Vocab 1000 (tokens "w0".."w999", word-level tokenizer), hidden 256, 4 layers, 8 heads,
2 KV heads, head_dim 32 (a head size vLLM's CPU attention supports), float32, tied
input/output embeddings, trained (``train``) for 100 Adam steps on a synthetic "lag-32
copy" language: token t repeats token t-32 with probability 0.9, else it is uniform on
3..999 (independently per position, so uniformly random prompts are in distribution).
Greedy decoding after any prompt of >= 33 tokens copies the prompt from 32 tokens back:
varied, decided by the cached KV (a head attends sharply to position t-32), and with real
argmax margins, so faithful KV gives the same tokens while wrong KV (another prompt's, a
misplaced block) changes them. Its sharp copy heads are also what makes KV precision
visible in attention, as a real model's induction heads do. A random init either repeats
one token forever (initializer_range 0.02) or, scaled up to avoid that, has logits so
wide (std ~64) that even a bfloat16 cache moves attention.

Training is not reproducible across machines (other CPU kernels, other thread counts and
other transformers versions give other models), so one trained model's weights are
committed (``data/tiny_llama_copy32.safetensors``, float16, 5 MB, sha256 pinned below)
and every machine loads exactly those. ``python -m kvstream.bench.tiny_llama --train``
remakes the file from the recipe (then update ``WEIGHTS_SHA256`` and the accuracy bounds
in tests/unit/test_accuracy.py, which are stated against these weights).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

from kvstream._exceptions import ConfigError

__all__ = ["LAG", "VOCAB", "WEIGHTS", "WEIGHTS_SHA256", "cached_model", "copy_prompt",
           "load_model", "make_model", "save_weights", "train"]

VOCAB: Final = 1000
LAG: Final = 32
WEIGHTS: Final = Path(__file__).resolve().parent / "data" / "tiny_llama_copy32.safetensors"
WEIGHTS_SHA256: Final = "0914cb35ef583dc533bd5f315663f8f9fe96727b8ff08df031769410676fd960"


def copy_prompt(gen: Any, batch: int, seq: int, lag: int = LAG, eps: float = 0.1) -> Any:
    """Token ids of the copy language, ``[batch, seq]`` (``gen``: a torch.Generator)."""
    import torch

    x = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    keep = torch.rand(batch, seq, generator=gen) >= eps
    for t in range(lag, seq):  # left to right: a copy of a copy is a copy
        x[:, t] = torch.where(keep[:, t], x[:, t - lag], x[:, t])
    return x


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, dtype="float32")


def train(seed: int = 0, steps: int = 100) -> dict[str, Any]:
    """The recipe behind ``WEIGHTS``: float32 weights after ``steps`` Adam steps.

    Not bit-reproducible across machines: the same seed gave four different models on one
    host under four CPU kernel choices (AVX-512, AVX2, generic, one thread), with e4m3
    attention cosines from 0.992 to 0.996. That is why the tests load the committed weights
    instead of training."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config()).float().train()
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
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}  # tied to the embedding


def save_weights(state: dict[str, Any], path: Path | str = WEIGHTS) -> str:
    """Write ``state`` as float16 safetensors (what ``WEIGHTS`` holds); returns its sha256."""
    import torch
    from safetensors.torch import save_file

    save_file({k: v.to(torch.float16).contiguous() for k, v in sorted(state.items())}, str(path))
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_model() -> Any:
    """The committed model in float32, checked against ``WEIGHTS_SHA256``."""
    from safetensors.torch import load
    from transformers import LlamaForCausalLM

    data = WEIGHTS.read_bytes()
    if hashlib.sha256(data).hexdigest() != WEIGHTS_SHA256:
        raise ConfigError(f"{WEIGHTS} is not the committed test model (sha256 mismatch); "
                          "reinstall kvstream")
    model = LlamaForCausalLM(_config())  # its random init is overwritten whole below
    state = {k: v.float() for k, v in load(data).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.float().eval()


def make_model(path: Path | str) -> Path:
    """``save_pretrained`` the committed model plus a WordLevel tokenizer into ``path``
    (kept if already there), for engines that load a model directory (vLLM). Needs
    transformers and tokenizers."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return path
    load_model().save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(path)
    return path


def cached_model() -> Path:
    """``make_model`` once per machine and environment, kept under
    ``kvstream.quant.cpu.cache_dir()``/models.

    Processes starting together build it once (an exclusive lock on the models directory),
    in a private directory renamed into place, so none reads half a model; a build killed
    mid-way leaves a ``.build-*`` directory the next build sweeps. Where the cache is not
    writable the model is built in a temporary directory for this process.
    """
    import fcntl

    import transformers

    from kvstream.quant.cpu import cache_dir

    # Keyed by the weights and the transformers that saves them (vLLM's environment pins
    # its own): another version's directory format is never loaded by mistake.
    key = hashlib.sha256(WEIGHTS_SHA256.encode() + transformers.__version__.encode()
                         + Path(__file__).read_bytes()).hexdigest()[:12]
    models = cache_dir() / "models"
    final = models / f"tiny-llama-copy{LAG}-{key}"
    if (final / "config.json").exists():
        return final
    try:
        models.mkdir(parents=True, exist_ok=True)
        lock = open(models / ".lock", "w")  # noqa: SIM115 (entered just below)
    except OSError:
        return make_model(Path(tempfile.mkdtemp(prefix="kvstream-tiny-llama-")) / "m")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists():  # built while we waited
            return final
        for stale in models.glob(".build-*"):  # only a dead builder leaves one (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=models, prefix=".build-"))
        try:
            make_model(tmp / "m")
            os.replace(tmp / "m", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    import argparse
    import time

    ap = argparse.ArgumentParser(description="the committed test model: save it as a model "
                                 "directory, or (--train) remake its weights from the recipe")
    ap.add_argument("out", nargs="?", default="tiny-llama",
                    help="model directory to write (or with --train: the safetensors file)")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    t = time.time()
    if args.train:
        print(args.out, "sha256", save_weights(train(args.seed, args.steps), args.out))
    else:
        print(make_model(args.out))
    print(f"{time.time() - t:.1f}s")
