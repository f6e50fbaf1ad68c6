#!/usr/bin/env python3
"""A random-weight llama GGUF for timing on a machine that cannot receive the real model.

The folder copied to an offline GPU host is kept under 64 MiB, and the embedded SmolLM2-135M alone is 98 MB. Timing does not
need trained weights, only the right shapes and a real tokenizer (the adapter picks single-token labels
and renders the chat template at load). So:

    # on the CPU machine: the tokenizer (vocabulary, merges, special ids, chat template) of a real GGUF, ~1 MB gzipped
    python tools/gpu/random_gguf.py tokenizer --from MODEL.gguf --out .gpu-carry/tokenizer.json.gz
    # on the GPU host: a llama-architecture model of the chosen shape with N(0, 0.02) F16 weights and that tokenizer
    python tools/gpu/random_gguf.py model --tokenizer .gpu-carry/tokenizer.json.gz --preset 3b --out /tmp/m.gguf

Its answers mean nothing; its speed is that of a trained model of the same shape and type.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time

import numpy as np

# llama shapes: (n_embd, n_layer, n_head, n_head_kv, n_ff). "3b" is about Llama-3.2-3B's body.
PRESETS = {
    "tiny": (256, 2, 4, 2, 512),
    "135m": (576, 30, 9, 3, 1536),  # SmolLM2-135M
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
}


def extract_tokenizer(source: str, out: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    fields = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        types = [t.name for t in field.types]
        value = field.contents()
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("utf-8")
        fields.append({"key": name, "types": types, "value": value})
    with gzip.open(out, "wt", encoding="utf-8") as fh:
        json.dump({"source": source.rsplit("/", 1)[-1], "fields": fields}, fh)
    print(f"{len(fields)} tokenizer fields from {source} -> {out}")


def make_model(tokenizer: str, preset: str, out: str, n_ctx: int, seed: int) -> None:
    import gguf

    n_embd, n_layer, n_head, n_head_kv, n_ff = PRESETS[preset]
    head_dim = n_embd // n_head
    with gzip.open(tokenizer, "rt", encoding="utf-8") as fh:
        tok = json.load(fh)
    n_vocab = next(len(f["value"]) for f in tok["fields"] if f["key"] == "tokenizer.ggml.tokens")

    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(f"random-llama-{preset}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for field in tok["fields"]:
        types = [gguf.GGUFValueType[t] for t in field["types"]]
        writer.add_key_value(field["key"], field["value"], types[0], types[1] if len(types) > 1 else None)

    rng = np.random.default_rng(seed)
    started = time.perf_counter()

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))  # tied: no output.weight
    writer.add_tensor("output_norm.weight", ones)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
        print(f"\r  layer {i + 1}/{n_layer}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"random {preset} llama (n_embd {n_embd}, {n_layer} layers, vocab {n_vocab}) -> {out} "
          f"in {time.perf_counter() - started:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokenizer", help="extract a GGUF's tokenizer fields to gzipped JSON")
    t.add_argument("--from", dest="source", required=True)
    t.add_argument("--out", required=True)
    m = sub.add_parser("model", help="write a random-weight llama GGUF with that tokenizer")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--preset", choices=sorted(PRESETS), default="3b")
    m.add_argument("--n-ctx", type=int, default=8192)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "tokenizer":
        extract_tokenizer(args.source, args.out)
    else:
        make_model(args.tokenizer, args.preset, args.out, args.n_ctx, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
