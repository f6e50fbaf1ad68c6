#!/usr/bin/env bash
# Vocabulary-only GGUFs for the tokenizer tests (tests/test_labels_debias.py): Qwen 2's and Llama 3's BPE,
# whose pre-tokenizers keep trailing newlines with punctuation (`>\n\n` is one token), unlike SmolLM2's.
# llama.cpp ships them (models/ggml-vocab-*.gguf, no weights) in the llama-cpp-python sdist the project
# pins; they are taken from there: nothing is fetched but that sdist, from the package registry (pip's
# cache usually has it from building llama-cpp-python).
#
# usage: tools/fetch_test_vocabs.sh [OUT_DIR]     (default .build/vocab)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-.build/vocab}")
# shellcheck source=tools/sdist_common.sh
. tools/sdist_common.sh
names=(ggml-vocab-qwen2.gguf ggml-vocab-llama-bpe.gguf)
have=1
for name in "${names[@]}"; do [ -s "$out/$name" ] || have=0; done
[ "$have" = 1 ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$version" ] && exit 0
mkdir -p "$out"
sdist=$(ls .build/llama-server/sdist/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)
[ -n "$sdist" ] || sdist=$(download_sdist "$out/sdist" "for its vocabulary-only GGUFs")
members=()
for name in "${names[@]}"; do members+=("llama_cpp_python-$version/vendor/llama.cpp/models/$name"); done
tar xzf "$sdist" -C "$out" --strip-components=4 "${members[@]}"
rm -rf "$out/sdist"
echo "$version" > "$out/VERSION"
