"""A tiny *trained* Llama for trying kvstream with vLLM, and for its tests (CPU, ~20-35 s,
no hub): ``python examples/vllm/tiny_model.py DIR``.

Vocab 1000 (tokens "w0".."w999", word-level tokenizer), hidden 256, 4 layers, 8 heads,
2 KV heads, head_dim 32 (a head size vLLM's CPU attention supports), float32, tied
input/output embeddings, trained for 100 Adam steps on a synthetic "lag-32 copy"
language: token t repeats token t-32 with probability 0.9, else it is uniform on 3..999
(independently per position, so uniformly random test prompts are in distribution).
Greedy decoding after any prompt of >= 33 tokens copies the prompt from 32 tokens back:
varied, decided by the cached KV (a head attends sharply to position t-32), and with real
argmax margins, so a faithful FP8 KV gives the same tokens while wrong KV (another
prompt's, a misplaced block) changes them. A random init either repeats one token forever
(initializer_range 0.02) or, scaled up to avoid that, is too ill-conditioned for FP8 KV.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 1000
LAG = 32


def _batch(gen, batch: int, seq: int, lag: int, eps: float):
    import torch

    x = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    keep = torch.rand(batch, seq, generator=gen) >= eps
    for t in range(lag, seq):  # left to right: a copy of a copy is a copy
        x[:, t] = torch.where(keep[:, t], x[:, t - lag], x[:, t])
    return x


def make_model(path: Path | str, seed: int = 0, steps: int = 100) -> Path:
    """Build, train and ``save_pretrained`` the model plus a WordLevel tokenizer into ``path``."""
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
        x = _batch(gen, batch=16, seq=96, lag=LAG, eps=0.1)
        logits = model(input_ids=x).logits[:, LAG - 1:-1]  # positions < LAG are unpredictable
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 x[:, LAG:].reshape(-1))
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


if __name__ == "__main__":
    import sys
    import time

    t = time.time()
    print(make_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"),
          f"{time.time() - t:.1f}s")
