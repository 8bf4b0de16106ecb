"""Tiny random-weight llama GGUF models for the real-engine tests.

The tests never download a model: they write one in about a second with the
``gguf`` package. The architecture is llama with a toy SentencePiece
vocabulary (byte tokens, letters, syllables and a few hundred two-syllable
words) and a ChatML chat template, so ``llama-server`` serves it through its
OpenAI endpoints like any chat model.

The output rows of the control and byte tokens are zero, so under the
server's default ``top_k`` the model never samples end-of-sequence or a raw
byte: every answer runs to exactly ``max_tokens`` (``finish_reason:
"length"``) and is valid UTF-8, which makes token counts deterministic.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Shape:
    """A model's size. The defaults are the smallest that serve (under 1 MB);
    ``SLOW`` is large enough to decode an order of magnitude slower."""

    embd: int = 64
    layers: int = 2
    heads: int = 4
    ff: int = 192
    ctx: int = 4096
    std: float = 0.05
    f16: bool = False


TINY = Shape()
SLOW = Shape(embd=384, layers=8, heads=6, ff=1536, std=0.02, f16=True)


def _vocab(seed: int) -> tuple[list[str], list[float], list[int], int]:
    """Tokens, scores and types; the count of tokens the model must never emit comes first."""
    from gguf import TokenType

    toks: list[str] = []
    scores: list[float] = []
    types: list[int] = []

    def add(text: str, score: float, kind: int) -> None:
        toks.append(text)
        scores.append(score)
        types.append(kind)

    add("<unk>", 0.0, TokenType.UNKNOWN)
    for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>"):
        add(t, 0.0, TokenType.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, TokenType.BYTE)
    never = len(toks)
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()":
        add(c, -10.0, TokenType.NORMAL)
        add("\u2581" + c, -9.0, TokenType.NORMAL)
    add("\u2581", -11.0, TokenType.NORMAL)
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    for s in syllables:
        add(s, -5.0, TokenType.NORMAL)
        add("\u2581" + s, -4.0, TokenType.NORMAL)
    words = sorted({a + b for a, b in itertools.product(syllables, syllables)})
    for w in random.Random(seed).sample(words, 300):
        add("\u2581" + w, -1.0, TokenType.NORMAL)
    return toks, scores, types, never


def write(path: Path, shape: Shape = TINY, seed: int = 0, name: str = "tiny-random-llama") -> Path:
    """Write a model of ``shape`` to ``path`` (deterministic for a seed) and return the path."""
    import numpy as np
    from gguf import GGUFWriter

    toks, scores, types, never = _vocab(seed)
    rng = np.random.default_rng(seed)
    dtype = np.float16 if shape.f16 else np.float32

    def matrix(rows: int, cols: int, std: float = shape.std):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(dtype)

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_vocab_size(len(toks))
    w.add_context_length(shape.ctx)
    w.add_embedding_length(shape.embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.heads)
    w.add_rope_dimension_count(shape.embd // shape.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1 if shape.f16 else 0)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", matrix(len(toks), shape.embd, 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(shape.embd, dtype=np.float32))
    out = rng.standard_normal((len(toks), shape.embd), dtype=np.float32) * 0.5
    out[:never] = 0.0  # never sampled: no end-of-sequence, no raw bytes
    w.add_tensor("output.weight", out.astype(dtype))
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(shape.embd, dtype=np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", matrix(shape.embd, shape.embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(shape.embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", matrix(shape.ff, shape.embd))
        w.add_tensor(p + "ffn_up.weight", matrix(shape.ff, shape.embd))
        w.add_tensor(p + "ffn_down.weight", matrix(shape.embd, shape.ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
