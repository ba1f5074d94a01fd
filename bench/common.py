"""Helpers shared by the benchmark scripts: real prompt text, memory accounting, timing and the
`docs/benchmarks.md` writer. Scripts run as `python bench/<name>.py` from the repository root."""

from __future__ import annotations

import datetime
import inspect
import os
import platform
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"


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


def dynamic_cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def paged_cache_bytes(cache) -> int:
    """Bytes of the distinct blocks a PagedCache holds (shared blocks once)."""
    blocks = {b for table in cache.block_tables() for b in table}
    return len(blocks) * cache.pool.bytes_per_block


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    return f"{device}; torch {torch.__version__}; Python {platform.python_version()}"


def revision() -> str:
    """The git commit the figures come from (+dirty when the tree has uncommitted changes)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


REVISION = revision()  # taken when the run starts: edits made while it runs do not count


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def record(section: str, body: str) -> None:
    """Print `body` and store it in docs/benchmarks.md under `section` (replacing the old figures),
    with the date, the machine and the command that produced it."""
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    stamp = datetime.date.today().isoformat()
    block = (f"<!-- {section} -->\n{body}\n\nMeasured {stamp} on {machine()}, code at {REVISION}, "
             f"with `{command}`.\n<!-- /{section} -->")
    print(body)
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- {re.escape(section)} -->.*?<!-- /{re.escape(section)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.parent.mkdir(exist_ok=True)
    BENCHMARKS_MD.write_text(text)
