"""A published load-testing client against the server, with its defaults: GuideLLM (vLLM's
project) drives `python -m hf_paged_kv.serve --model smollm2` through its OpenAI backend (chat
completions, streamed, with vLLM's `stream_options.continuous_usage_stats`), and the table says
how many of its requests failed.

    python bench/bench_clients.py              # 3 repeats of 24 requests, 4 streams; writes its section
    python bench/bench_clients.py --smoke      # one repeat of 4 requests; prints only

Only what the machine forces is set: the target, a request count, synthetic prompts and the
tokenizer to make them with (a local directory: nothing is downloaded). Requires `guidellm` (the
bench extra) and the demo's SmolLM2 (`bash scripts/demo.sh`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common
from common import Checks, arguments, markdown_table, note

from hf_paged_kv.serve import smollm2_directory

PROMPT_TOKENS, OUTPUT_TOKENS, STREAMS = 64, 16, 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "hf_paged_kv.serve", "--model", "smollm2", "--port", str(port),
                               "--log-level", "warning"], env=os.environ | {"HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
        if server.poll() is not None:
            break
    server.kill()
    raise SystemExit("the server did not start")


def guidellm(port: int, requests: int, out: Path) -> dict:
    """One GuideLLM run; its benchmark's metrics."""
    command = ["guidellm", "run", "--backend", f"kind=openai_http,target=http://127.0.0.1:{port}",
               "--profile", f"kind=concurrent,streams={STREAMS}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=hf_auto,model={smollm2_directory()}",
               "--disable-progress", "--output", f"kind=json,path={out}"]
    done = subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:]], capture_output=True,
                          text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())["benchmarks"][0]["metrics"]


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="requests per run (default 24; 4 in --smoke)")
    args = parser.parse_args()
    common.check_repeats(args)
    requests = args.requests or (4 if args.smoke else 24)
    repeats = 1 if args.smoke else args.repeats
    port, checks, runs = free_port(), Checks(), []
    server = start_server(port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(repeats):
                metrics = guidellm(port, requests, Path(tmp) / f"run{k}.json")
                runs.append(metrics)
                totals = metrics["request_totals"]
                note(f"run {k + 1}/{repeats}: {totals['successful']} of {totals['total']} succeeded")
    finally:
        server.terminate()
        server.wait(timeout=60)

    def median(key: str, stat: str = "median") -> float:
        return statistics.median(m[key]["successful"][stat] for m in runs)

    totals = {key: sum(m["request_totals"][key] for m in runs) for key in ("successful", "errored", "incomplete")}
    checks.expect(totals["errored"] == 0 and totals["incomplete"] == 0,
                  f"GuideLLM saw {totals['errored']} errored and {totals['incomplete']} incomplete requests")
    rows = [["GuideLLM, chat completions, streamed", f"{requests} x {repeats}", totals["successful"],
             totals["errored"], totals["incomplete"], f"{median('time_to_first_token_ms') / 1e3:.2f}",
             f"{median('inter_token_latency_ms'):.0f}", f"{median('output_tokens_per_second', 'mean'):.1f}"]]
    body = "\n".join([
        "### A load-testing client with its defaults (GuideLLM against the server, SmolLM2, CPU)", "",
        f"`guidellm run` with its OpenAI backend's defaults (chat completions, streamed, vLLM's "
        f"`continuous_usage_stats`), {STREAMS} concurrent streams, synthetic prompts of {PROMPT_TOKENS} tokens "
        f"asking for {OUTPUT_TOKENS}; the server as `python -m hf_paged_kv.serve --model smollm2` starts it. "
        "Medians over the runs of GuideLLM's own medians.", "",
        markdown_table(["client", "requests", "succeeded", "errored", "incomplete", "TTFT s", "ITL ms",
                        "output tokens/s per request"], rows), ""])
    return checks.finish("bench_clients", body, args.smoke, after="engine")


if __name__ == "__main__":
    sys.exit(main())
