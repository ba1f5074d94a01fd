"""Helpers shared by the benchmark scripts: the models (SmolLM2, or a tiny random model for
`--smoke`), real prompt text, memory accounting, fair timing, checks, and the `docs/benchmarks.md`
writer. Scripts run as `python bench/<name>.py` from the repository root (or from anywhere: they
never put the repository root on `sys.path`).

Every script follows the same rules:

- the systems compared run in the same process, alternately: one untimed warm-up run of each,
  then `--repeats` rounds whose order is rotated every round; a figure is the median over the
  rounds, and every ratio compares medians of this run;
- the baseline is a model that was never enabled (plain `DynamicCache` with its own attention),
  with the same weights as the paged model;
- outputs are checked against `DynamicCache`; a failed check of the paged side (fp32) makes the
  script exit 1 without writing anything to `docs/benchmarks.md`;
- `--smoke` runs everything at toy sizes on a tiny random model in a few seconds and only prints;
- `--quick` (what `bench/run_all.py --quick` passes, with reduced sizes) records fewer than 3
  repeats and says "quick mode" next to the command, so that its figures are not taken for a full
  run's.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import inspect
import os
import shlex
import platform
import re
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
# where `record` writes; bench/run_all.py --docs sets it for the scripts it runs
BENCHMARKS_MD = Path(os.environ.get("HF_PAGED_KV_BENCHMARKS_MD") or ROOT / "docs" / "benchmarks.md")
QUICK_NOTE = "quick mode"  # what a --quick run's section says next to its command (bench/run_all.py)

# ---------------------------------------------------------------------------------- models

SMOKE_VOCAB = 512


class SmokeTokenizer:
    """A word-level stand-in for a tokenizer (smoke runs only): each word maps to a fixed id."""

    pad_token_id = 0

    def __init__(self, vocab: int = SMOKE_VOCAB):
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + zlib.crc32(word.encode()) % (self.vocab - 3) for word in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{int(i)}" for i in ids)


class SmokeEmbedder:
    """A hashed bag-of-words embedder with the `encode` of sentence-transformers (smoke runs only,
    so that they do not load all-MiniLM-L6-v2)."""

    def encode(self, texts, normalize_embeddings: bool = True, convert_to_numpy: bool = True):
        vectors = np.zeros((len(texts), 64), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.split():
                vectors[row, zlib.crc32(word.encode()) % 64] += 1
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-6)


def smoke_model(dtype=torch.float32):
    """A tiny random Llama (2 layers, GQA 4/2 heads, sharp attention), identical weights every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=SMOKE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(dtype)
    model.generation_config.pad_token_id = 0
    return model


def smollm2_loader():
    """`load_smollm2` from `examples/real_model.py` (the demo's loader; the library does not ship
    model loaders)."""
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "examples" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_smollm2


def load_model(smoke: bool, dtype=torch.float32):
    """`(model, tokenizer)`: SmolLM2-135M-Instruct, or the tiny random model in smoke runs. Each
    call returns a new model object with the same weights."""
    if smoke:
        torch.set_num_threads(1)  # tiny matmuls: threads only add synchronization (3x slower on 2 busy cores)
        return smoke_model(dtype), SmokeTokenizer()
    return smollm2_loader()(dtype=dtype)


def model_name(smoke: bool) -> str:
    return "tiny random Llama (smoke run)" if smoke else "SmolLM2-135M"


def semantic_embedder(smoke: bool):
    """None (the library's default, all-MiniLM-L6-v2) in full runs; a toy embedder in smoke runs."""
    return SmokeEmbedder() if smoke else None


# --------------------------------------------------------------------------------- prompts

@functools.lru_cache(maxsize=1)
def real_text() -> str:
    """English prose that is on every machine with transformers installed: the docstrings of its
    generation utilities (reproducible, not lorem ipsum)."""
    import transformers.generation.utils as source

    docs = [inspect.getdoc(obj) or "" for _, obj in inspect.getmembers(source)]
    docs += [inspect.getdoc(fn) or "" for _, fn in inspect.getmembers(source.GenerationMixin, inspect.isfunction)]
    text = " ".join(" ".join(d.split()) for d in docs if len(d) > 200)
    return re.sub(r"`+", "", text)


def prompts_of_lengths(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts cut from `real_text()` at seeded offsets, one per requested length."""
    ids = tokenizer(real_text(), add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        start = int(torch.randint(0, len(ids) - n, (1,), generator=gen))
        prompts.append(ids[start : start + n])
    return prompts


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def greedy(model, ids, cache, new_tokens: int, mask=None):
    """`model.generate`, greedy, exactly `new_tokens` new tokens; `ids` a prompt (list or 1-D) or a batch."""
    ids = torch.as_tensor(ids)
    ids = ids[None] if ids.dim() == 1 else ids
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)


# ---------------------------------------------------------------------------------- memory

def dynamic_cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def paged_cache_bytes(cache) -> int:
    """Bytes of the distinct blocks a PagedCache holds (shared blocks once)."""
    blocks = {b for table in cache.block_tables() for b in table}
    return len(blocks) * cache.pool.bytes_per_block


def contiguous_runs(table: list[int]) -> int:
    """How many runs of consecutive block ids a block table is made of (1: one contiguous run)."""
    return 1 + sum(1 for a, b in zip(table, table[1:]) if b != a + 1) if table else 0


def mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


# ---------------------------------------------------------------------------------- timing

class Timer:
    """Accumulates the seconds spent inside `with timer:` blocks (so that setup stays untimed)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._start


def alternate(systems: dict, repeats: int, warmup: bool = True, progress: str = "") -> dict:
    """Run each `systems[name]()` (returning `(seconds, output)`) once untimed as a warm-up, then
    `repeats` rounds in an order rotated every other round and reversed in between. Returns `{name: {"times": [...],
    "median": s, "outputs": [...]}}` (outputs of the timed rounds)."""
    names = list(systems)
    if warmup:
        for name in names:
            note(f"{progress}warm-up: {name}")
            systems[name]()
    runs = {name: {"times": [], "outputs": []} for name in names}
    for round_ in range(repeats):
        # rotated every other round and reversed in between: the systems take turns going first,
        # and none always follows the same one (a rotation alone keeps every neighbour)
        shift = (round_ // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if round_ % 2 else order:
            note(f"{progress}run {round_ + 1}/{repeats}: {name}")
            seconds, output = systems[name]()
            runs[name]["times"].append(seconds)
            runs[name]["outputs"].append(output)
    for run in runs.values():
        run["median"] = statistics.median(run["times"])
    return runs


def method(repeats: int, what: str = "") -> str:
    """The sentence every section puts next to its figures."""
    return (f"Method: median of {repeats} runs per system after one untimed warm-up run of each; the systems run "
            f"alternately in one process, their order rotated every other run and reversed in between (none "
            f"always follows the same one){what}.")


_START = time.perf_counter()


def note(message: str) -> None:
    """Progress on stderr (the tables go to stdout)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- checks

class Checks:
    """Correctness checks of one run. `failed()` ones make the script exit 1 and write nothing."""

    def __init__(self):
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return ok

    def finish(self, section: str, body: str, smoke: bool, **record_options) -> int:
        """Print (and in a full run record) the section, or say what failed; the exit status."""
        if self.failures:
            print(body)
            print("\nFAILED CHECKS (nothing written to docs/benchmarks.md):")
            for failure in self.failures:
                print(f"- {failure}")
            return 1
        record(section, body, write=not smoke, **record_options)
        return 0


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def yes_no(ok: bool) -> str:
    return "yes" if ok else "NO"


# ------------------------------------------------------------------------------ arguments

def plot_path(args, name: str) -> Path:
    """Where a figure goes: `--plot PATH`, else docs/<name>.png (a temp dir in smoke runs). Also
    selects matplotlib's non-interactive backend."""
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    if getattr(args, "plot", None):
        return Path(args.plot)
    if args.smoke:
        return Path(tempfile.mkdtemp(prefix=f"{name}_")) / f"{name}.png"
    return BENCHMARKS_MD.parent / f"{name}.png"  # next to the file that links it


def arguments(description: str, repeats: int = 3) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on a tiny random model, a few seconds; prints only (docs untouched)")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs per system (>= 3 for the docs)")
    parser.add_argument("--quick", action="store_true",
                        help="allow --repeats < 3 in the docs; the section says \"quick mode\" next to its command "
                             "(bench/run_all.py --quick passes it with reduced sizes)")
    return parser


def check_repeats(args) -> None:
    if not args.smoke and not getattr(args, "quick", False) and args.repeats < 3:
        raise SystemExit("--repeats must be >= 3 for figures that are recorded (use --smoke to try the script, "
                         "--quick to record reduced runs marked as such)")


# --------------------------------------------------------------------------------- records

def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    return f"{device}; torch {torch.__version__}; Python {platform.python_version()}"


def revision() -> str:
    """The git commit the figures come from (+dirty when code has uncommitted changes; the
    figures in docs/ being written meanwhile do not count)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs") else "")


REVISION = revision()  # taken when the run starts: edits made while it runs do not count


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def record(section: str, body: str, write: bool = True, replaces: str | None = None, after: str | None = None) -> None:
    """Print `body` and, when `write`, store it in docs/benchmarks.md under `section` (replacing
    the old figures), with the date, the machine, the commit and the command that produced it.

    A section not in the file yet replaces the text matching the regex `replaces` (a hand-written
    predecessor), else goes right after the section `after`, else at the end."""
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    quick = (f" ({QUICK_NOTE}: sizes cut for a 2-core CPU, not comparable with a full run)"
             if "--quick" in sys.argv[1:] else "")
    stamp = datetime.date.today().isoformat()
    print(body)
    if not write:
        print("\n(smoke run: docs/benchmarks.md not written)")
        return
    block = (f"<!-- {section} -->\n{body}\n\nMeasured {stamp} on {machine()}, code at {REVISION}, "
             f"with `{command}`{quick}.\n<!-- /{section} -->")
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- {re.escape(section)} -->.*?<!-- /{re.escape(section)} -->", re.S)
    anchor = re.compile(rf"<!-- /{re.escape(after)} -->\n") if after else None
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    elif replaces and re.search(replaces, text, re.S):
        text = re.sub(replaces, lambda _: block + "\n\n", text, count=1, flags=re.S)
    elif anchor and anchor.search(text):
        text = anchor.sub(lambda m: m.group(0) + "\n" + block + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.parent.mkdir(exist_ok=True)
    BENCHMARKS_MD.write_text(text)
