"""Serving over HTTP, apart from the engine: an OpenAI-compatible app on an `Engine` (`app`) and
the command that loads a local model and serves it (`cli`).

    python -m hf_paged_kv.serve --model DIR [--port 8000] [--max-num-seqs 64] [--slo-ttft S --slo-tpot S]
    hf-paged-kv-serve --model smollm2          # the SmolLM2-135M-Instruct the demo converted

See `cli` for every flag (`python -m hf_paged_kv.serve --help`) and `app` for the routes. The
app needs the `serve` extra (FastAPI + uvicorn); importing this package does not.
"""

from .cli import build_app, engine_config, load, main, parse_args, smollm2_directory

__all__ = ["main", "parse_args", "engine_config", "build_app", "load", "smollm2_directory"]
