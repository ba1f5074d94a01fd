#!/usr/bin/env bash
# The README's main job: bootstrap .venv, then chat with SmolLM2 through PagedCache.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$(bash "$root/scripts/bootstrap.sh")"
exec "$python" "$root/examples/chat_demo.py" "$@"
