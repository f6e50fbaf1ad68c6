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
py=${PY:-.venv/bin/python}
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' container/pyproject.toml)
[ -n "$version" ] || { echo "cannot read the llama-cpp-python pin from container/pyproject.toml" >&2; exit 1; }
names=(ggml-vocab-qwen2.gguf ggml-vocab-llama-bpe.gguf)
have=1
for name in "${names[@]}"; do [ -s "$out/$name" ] || have=0; done
[ "$have" = 1 ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$version" ] && exit 0
mkdir -p "$out"
sdist=$(ls .build/llama-server/sdist/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)
if [ -z "$sdist" ]; then
  echo ">> fetching the llama-cpp-python $version sdist for its vocabulary-only GGUFs" >&2
  "$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$out/sdist" >&2
  sdist="$out/sdist/llama_cpp_python-$version.tar.gz"
fi
members=()
for name in "${names[@]}"; do members+=("llama_cpp_python-$version/vendor/llama.cpp/models/$name"); done
tar xzf "$sdist" -C "$out" --strip-components=4 "${members[@]}"
rm -rf "$out/sdist"
echo "$version" > "$out/VERSION"
