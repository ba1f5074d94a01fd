#!/usr/bin/env bash
# The README's test command: bootstrap .venv, then run the whole suite (slow real-model tests included).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$(bash "$root/scripts/bootstrap.sh")"
cd "$root/tests"  # not the repo root: ./kernels must never shadow the `kernels` package on sys.path
exec "$python" -m pytest "$root/tests" "$@"
