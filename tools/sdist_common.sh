# Sourced by tools/build_llama_server.sh and tools/fetch_test_vocabs.sh (not run on its own): the
# llama-cpp-python pin and its sdist, the one thing either script takes from the package registry.
# Sets `version` (the pin in container/pyproject.toml) and `py` (the Python that runs pip).
py=${PY:-.venv/bin/python}
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' container/pyproject.toml)
[ -n "$version" ] || { echo "cannot read the llama-cpp-python pin from container/pyproject.toml" >&2; exit 1; }

# download_sdist DIR WHY: put llama_cpp_python-$version.tar.gz in DIR and print its path.
download_sdist() {
  echo ">> fetching the llama-cpp-python $version sdist ($2)" >&2
  "$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$1" >&2
  echo "$1/llama_cpp_python-$version.tar.gz"
}
