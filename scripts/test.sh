#!/usr/bin/env bash
# The README's test command: bootstrap .venv, then run the whole suite (slow real-model tests included).
# Arguments go to pytest; test files or folders among them (paths from where you call it, or
# relative to tests/) run instead of the whole suite: bash scripts/test.sh tests/test_engine.py -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$(bash "$root/scripts/bootstrap.sh")"
args=() picked=0
for arg in "$@"; do
  path="${arg%%::*}"  # a node id's file (tests/test_x.py::test_y)
  if [[ $arg != -* && -e $path ]]; then
    args+=("$(cd "$(dirname "$path")" && pwd)/$(basename "$arg")") picked=1
  elif [[ $arg != -* && -e $root/tests/$path ]]; then
    args+=("$root/tests/$arg") picked=1
  else
    args+=("$arg")
  fi
done
(( picked )) || args=("$root/tests" "${args[@]}")
cd "$root/tests"  # not the repo root: ./kernels must never shadow the `kernels` package on sys.path
exec "$python" -m pytest "${args[@]}"
