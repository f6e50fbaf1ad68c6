"""Small real GGUFs built for one behaviour each (plain module, importable as `ggufs`).

`tiny_llama` writes a llama-architecture model with the embedded model's tokenizer and weights chosen so
that its next-token logits are known: every layer's output projections are zero, so the residual stream
is the last token's embedding; the final norm keeps only dimension 0, which is positive for every token;
so each token's logit is its output row's first weight times a positive number. A row of -inf gives a
token that llama.cpp scores -inf after any prompt. Its answers mean nothing; llama.cpp runs it like any
other model (about 20 MB, loads in well under a second).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np


@functools.lru_cache(maxsize=2)
def tokenizer_fields(source: str) -> tuple[tuple[str, tuple, object], ...]:
    """(key, value types, value) of every `tokenizer.*` field of a GGUF, read once per source."""
    import gguf

    reader = gguf.GGUFReader(source, "r")
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            fields.append((name, tuple(field.types), field.contents()))
    return tuple(fields)


def token_ids(source: str, texts: Iterable[str]) -> dict[str, int]:
    """Vocabulary ids of exact token strings (byte-level BPE spells a leading space `Ġ`)."""
    tokens = next(value for key, _, value in tokenizer_fields(source) if key == "tokenizer.ggml.tokens")
    index = {token: i for i, token in enumerate(tokens)}
    return {text: index[text] for text in texts}


def tiny_llama(
    out: Path,
    tokenizer_source: Path,
    *,
    chat_template: bool = True,
    keep_merge: Optional[Callable[[str], bool]] = None,
    ruled_out: Iterable[int] = (),
    metadata: Optional[dict[str, str]] = None,
    n_embd: int = 64,
    seed: int = 0,
) -> Path:
    """Write the model described in the module docstring to ``out``.

    ``chat_template=False`` drops `tokenizer.chat_template`; ``keep_merge`` filters the BPE merges (a
    merge dropped is a token the tokenizer can no longer produce); ``ruled_out`` token ids score -inf;
    ``metadata``: extra string keys (e.g. a native decision model's)."""
    import gguf

    n_layer, n_head, n_head_kv, n_ff = 1, 2, 1, 64
    head_dim = n_embd // n_head
    fields = tokenizer_fields(str(tokenizer_source))
    n_vocab = next(len(value) for key, _, value in fields if key == "tokenizer.ggml.tokens")

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(2048)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, types, value in fields:
        if key == "tokenizer.chat_template" and not chat_template:
            continue
        if key == "tokenizer.ggml.merges" and keep_merge is not None:
            value = [merge for merge in value if keep_merge(merge)]
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)

    rng = np.random.default_rng(seed)
    embedding = (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float32)
    embedding[:, 0] = 1.0  # dimension 0 positive for every token: the final norm's output keeps its sign
    output = np.zeros((n_vocab, n_embd), dtype=np.float32)
    output[:, 0] = rng.standard_normal(n_vocab).astype(np.float32) * 0.3
    for token in ruled_out:
        output[token, 0] = -np.inf
    norm = np.zeros(n_embd, dtype=np.float32)
    norm[0] = 1.0
    ones = np.ones(n_embd, dtype=np.float32)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output_norm.weight", norm)
    writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((n_embd, n_embd), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((n_embd, n_ff), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# A byte-level BPE merge is "left right"; one whose result starts with a space and a capital letter
# (`Ġ A` → `ĠA`, `ĠY es` → `ĠYes`) dropped, " A" or " Yes" is two tokens: a plain layout (labels written
# after "Answer:") then finds no single-token capital letter and no single-token Yes/No.
SPACE_CAPITAL = re.compile(r"^Ġ[A-Z]")


def drops_space_capitals(except_result: str = "") -> Callable[[str], bool]:
    """A ``keep_merge`` that drops every merge producing `Ġ<capital>…`, except the one producing ``except_result``."""

    def keep(merge: str) -> bool:
        result = merge.replace(" ", "")
        return result == except_result or not SPACE_CAPITAL.match(result)

    return keep
