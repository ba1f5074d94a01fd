"""The README and docs/ say what exists and what runs.

- README.md: at most 150 lines, and its python blocks run as pasted, as one script (the quickstart
  on the SmolLM2 the demo converts, the `openai` client against the serve command it shows).
- docs/*.md: their python blocks run, but fragments marked `<!-- not run (why) -->`.
- README.md and docs/*.md: relative links reach existing files (and headings), the library names
  they mention exist (`hf_paged_kv.X`, `from hf_paged_kv... import X`, the keyword arguments of
  the calls they show, `Limits.x`), their python blocks compile, the scripts they name exist, and
  the serve flags they show are the server's.
- docs/*.md documents every statistics key of `KVPool.stats()` (both tiers, a semantic index) and
  `Engine.stats()` (its controller's settings too), and names no key that does not exist.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_model

import hf_paged_kv
from hf_paged_kv import SLO, Engine, EngineConfig, KVPool, Limits, PagedCache, SemanticIndex, Thresholds

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# what each section of the benchmarks page ran, at the commit it states: the switches and
# arguments it names may be gone since (history is git's)
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MAX_README_LINES = 150


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def code_blocks(source: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}[ \t]*\n(.*?)^```", source, flags=re.M | re.S)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ---------------------------------------------------------------------------------- README


def test_readme_is_at_most_150_lines():
    lines = text(README).splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the depth belongs in docs/"


def test_readme_has_the_two_commands_and_an_install_line():
    readme = text(README)
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh", "pip install -e ."):
        assert command in readme


def test_readme_results_are_quoted_from_the_benchmarks():
    """Each row of the README's results table quotes docs/benchmarks.md: its ratios and shares
    appear there (at that precision or finer), and so does its command, as the benchmarks page
    names it under the table it produced."""
    readme, benchmarks = text(README), text(ROOT / "docs" / "benchmarks.md")
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("|") and not r.startswith(("| workload", "|---"))]
    assert len(rows) >= 5
    unquoted = []
    for row in rows:
        workload, figure, baseline, command = (cell.strip() for cell in row.strip("|").split("|"))
        for number, unit in re.findall(r"(\d+(?:\.\d+)?)(x|%)", figure + " " + baseline):
            if not re.search(rf"(?<![\d.]){re.escape(number)}\d*{unit}", benchmarks):
                unquoted.append(f"{workload}: {number}{unit}")
        if f"with {command}" not in benchmarks:
            unquoted.append(f"{workload}: {command}")
    assert unquoted == [], f"README.md results not found in docs/benchmarks.md: {unquoted}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(readme: str) -> list[str]:
    """The README's serve command, as an argument list (its trailing `&` and comment dropped)."""
    for block in code_blocks(readme, "bash"):
        for line in block.splitlines():
            if line.startswith("python -m hf_paged_kv.serve"):
                return shlex.split(line.split("#")[0].replace("&", " "))
    raise AssertionError("README.md shows no `python -m hf_paged_kv.serve` command")


@contextlib.contextmanager
def running(command: list[str], port: int, env: dict, cwd: Path, timeout: float = 300.0):
    log = cwd / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"the server did not come up: {log.read_text()[-3000:]}"
                time.sleep(1.0)
            yield server
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@pytest.mark.slow
def test_readme_python_blocks_run_as_pasted(smollm2, tmp_path):
    """Every python block of the README, in order, as one script in a fresh interpreter, offline,
    from an empty directory; the `openai` client talks to the README's serve command (on a free
    port instead of 8000). `smollm2` converts the demo's model first where it is missing."""
    readme = text(README)
    blocks = code_blocks(readme, "python")
    assert blocks, "README.md has no python block"
    port = free_port()
    script = "\n\n".join(blocks).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    (tmp_path / "readme.py").write_text(script)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    command = serve_command(readme)
    assert command[:3] == ["python", "-m", "hf_paged_kv.serve"] and "8000" in command
    command = [sys.executable, *command[1:]]
    command[command.index("8000")] = str(port)
    with running(command, port, env, tmp_path):
        done = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
    assert done.returncode == 0, f"README.md's python blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    reused = re.search(r"^(\d+) prompt tokens reused$", done.stdout, flags=re.M)
    assert reused and int(reused.group(1)) > 0, done.stdout  # the second question inherited the system prompt


# ----------------------------------------------------------------------- links and names


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    source = re.sub(r"^```.*?^```", "", text(page), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", source, flags=re.M)}


def links(page: Path) -> list[str]:
    source = re.sub(r"^```.*?^```", "", text(page), flags=re.M | re.S)
    source = re.sub(r"`[^`\n]*`", "", source)
    return re.findall(r"\]\(([^)\s]+)\)", source)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_reach_existing_files(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert broken == [], f"{page_id(page)}: {broken}"


def resolve(dotted: str):
    """Import the longest module prefix of `dotted`, then get the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            thing = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            thing = getattr(thing, name)
        return thing
    raise ModuleNotFoundError(dotted)


def named_objects(source: str) -> set[str]:
    names = set(re.findall(r"\bhf_paged_kv(?:\.[A-Za-z_]\w*)+", source))
    for module, imported in re.findall(r"^\s*from (hf_paged_kv[\w.]*) import ([\w, ()]+?)\s*(?:#.*)?$", source, flags=re.M):
        names |= {f"{module}.{n.strip()}" for n in imported.strip("()").split(",") if n.strip()}
    return names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_library_objects_exist(page):
    missing = []
    for name in sorted(named_objects(text(page))):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
    assert missing == [], f"{page_id(page)} names what the library lacks: {missing}"


CALLABLES = {"KVPool": KVPool, "PagedCache": PagedCache, "Engine": Engine, "EngineConfig": EngineConfig, "SLO": SLO,
             "SemanticIndex": SemanticIndex, "Limits": Limits, "Thresholds": Thresholds,
             "engine.submit": Engine.submit, "enable": hf_paged_kv.enable, "pin": hf_paged_kv.pin,
             "persist": hf_paged_kv.persist, "publish": hf_paged_kv.publish,
             "advise_block_size": hf_paged_kv.advise_block_size}


def keywords(function) -> set[str]:
    """The keywords `function` takes; `Engine(**settings)` takes `EngineConfig`'s fields (and the
    older names the engine maps onto them)."""
    parameters = inspect.signature(function).parameters
    names = {n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
    if function is Engine:
        from hf_paged_kv.engine import engine as module

        names |= set(EngineConfig.__dataclass_fields__) | set(getattr(module, "LEGACY_NAMES", {}))
    elif any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise AssertionError(f"{function.__qualname__} takes **kwargs: say here which keywords it accepts")
    return names


def top_level_keywords(source: str, start: int) -> list[str]:
    """The keywords of the call whose `(` is at `start`, not those of calls nested in it."""
    depth, level = 0, []
    for char in source[start:]:
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            break
        level.append(char if depth == 1 else " ")
    return re.findall(r"(?:^|[(,]\s*)(\w+)=(?!=)", "".join(level))


@pytest.mark.parametrize("page", [page for page in PAGES if page != BENCHMARKS], ids=page_id)
def test_keyword_arguments_and_fields_shown_exist(page):
    """`KVPool(ttl=...)`, `PagedCache(pin_turns=N)`, `Engine(..., slo=...)`, `Limits.growth_clip`:
    every keyword a page passes to a library call, and every `Limits.x` / `Thresholds.x` it
    names, is one the library has."""
    source = text(page)
    wrong = []
    callee = "|".join(re.escape(n) for n in sorted(CALLABLES, key=len, reverse=True))
    for call in re.finditer(rf"(?<![\w.])(?:hf_paged_kv\.)?({callee})\(", source):
        accepted = keywords(CALLABLES[call.group(1)])
        for keyword in top_level_keywords(source, call.end() - 1):
            if keyword not in accepted:
                wrong.append(f"{call.group(1)}({keyword}=)")
    for owner, field in re.findall(r"\b(Limits|Thresholds)\.(\w+)", source):
        if not hasattr(CALLABLES[owner], field):
            wrong.append(f"{owner}.{field}")
    assert wrong == [], f"{page_id(page)} shows arguments the library does not take: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_compile(page):
    for number, block in enumerate(code_blocks(text(page), "python")):
        compile(block, f"{page_id(page)}, python block {number + 1}", "exec")


NOT_RUN = "<!-- not run"  # the line before a fragment's fence: compiled, not run


def runnable_blocks(source: str) -> list[str]:
    return [block for marker, block in re.findall(r"^(<!-- not run[^\n]*\n)?```python[ \t]*\n(.*?)^```", source,
                                                  flags=re.M | re.S) if not marker]


DOCS_WITH_EXAMPLES = [p for p in DOCS if runnable_blocks(text(p))]


def test_docs_examples_are_run_unless_marked():
    """The usage, engine and tiers pages hold examples that run; a fragment says why it is not run."""
    assert {p.name for p in DOCS_WITH_EXAMPLES} >= {"usage.md", "engine.md", "pins-and-tiers.md"}
    for page in DOCS:
        for marker in re.findall(rf"^{NOT_RUN}.*$", text(page), flags=re.M):
            assert re.fullmatch(r"<!-- not run \(.+\) -->", marker), f"{page.name}: say why: {marker}"


@pytest.mark.slow
@pytest.mark.parametrize("page", DOCS_WITH_EXAMPLES, ids=page_id)
def test_docs_examples_run(smollm2, page, tmp_path):
    """A page's python blocks not marked `<!-- not run (why) -->`, in order, as one script in a
    fresh interpreter, offline, from an empty directory (they load the demo's SmolLM2, which
    `smollm2` converts first where it is missing)."""
    (tmp_path / "example.py").write_text("\n\n".join(runnable_blocks(text(page))))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "example.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page_id(page)}'s examples failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_scripts_and_files_named_exist(page):
    source = text(page)
    named = set(re.findall(r"\b((?:bench|scripts|examples|kernels|tests)/[\w/]+\.(?:py|sh))\b", source))
    named |= {f"hf_paged_kv/{m}" for m in re.findall(r"`(engine/\w+\.py)`", source)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"{page_id(page)} names files that do not exist: {missing}"


def test_serve_flags_shown_are_the_servers():
    from hf_paged_kv import serve

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    known = set(re.findall(r"--[\w-]+", out.getvalue()))
    shown = set()
    for page in PAGES:
        for line in text(page).splitlines():
            if "hf_paged_kv.serve" in line or "hf-paged-kv-serve" in line or line.startswith("    ["):
                shown |= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
        shown |= set(re.findall(r"`(--(?:slo|max|num|block|served|default|dtype|device|host|port)[\w-]*)", text(page)))
    assert shown, "no serve flags found in the docs"
    assert shown - known == set(), f"the docs show serve flags the server does not take: {shown - known}"


def test_engine_page_documents_every_setting_and_flag():
    from hf_paged_kv import serve

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    flags = set(re.findall(r"--[a-z][\w-]*", out.getvalue())) - {"--help"}
    page = text(ROOT / "docs" / "engine.md")
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page))
    missing += sorted(f for f in EngineConfig.__dataclass_fields__ if f"`{f}`" not in page)
    assert missing == [], f"docs/engine.md does not document: {missing}"


def test_error_table_names_exist():
    page = ROOT / "docs" / "usage.md"
    rows = re.findall(r"^\| `(\w+)`(?: itself)? \|", text(page), flags=re.M)
    errors = [r for r in rows if r.endswith(("Error", "Failed")) or r == "Overloaded"]
    assert len(errors) >= 8
    for name in errors:
        assert issubclass(getattr(hf_paged_kv, name), hf_paged_kv.PagedKVError), name


# ------------------------------------------------------------------------------ statistics


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class StubEmbedder:
    def encode(self, texts, normalize_embeddings=True, convert_to_numpy=True):
        return np.ones((len(texts), 4), dtype=np.float32) / 2


@pytest.fixture(scope="module")
def statistics(tmp_path_factory):
    """The keys of `KVPool.stats()` with both tiers and a semantic index, `Engine.stats()` and its
    controller's settings (with SLO targets, so the controller runs), and a pin's entry."""
    model = make_model("llama", seed=1)
    semantic = SemanticIndex(StubTokenizer(), embedder=StubEmbedder())  # no sentence-transformers model
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=8, host_blocks=8, semantic=semantic,
                                                 disk_dir=tmp_path_factory.mktemp("disk")))
    pin = hf_paged_kv.pin(model, list(range(3, 20)))
    engine = Engine(model, pool=pool, slo=SLO(ttft=5.0, per_token=1.0))
    try:
        with engine:
            engine.submit([5, 6, 7], max_new_tokens=2, eos_token_id=[]).result(timeout=60)
        stats = engine.stats()
    finally:
        hf_paged_kv.unpin(model, pin)
        hf_paged_kv.disable(model)
    assert stats["pins"], "the pin should be listed"
    return {"pool": set(pool.stats()), "engine": set(stats) - set(pool.stats()),
            "controller": set(stats["controller"]), "pin": set(stats["pins"][0])}


def documented(keys) -> dict[str, bool]:
    docs = "\n".join(text(p) for p in DOCS)
    return {k: bool(re.search(rf"`{re.escape(k)}`", docs)) for k in keys}


@pytest.mark.parametrize("kind", ["pool", "engine", "controller", "pin"])
def test_every_statistic_is_documented_in_docs(statistics, kind):
    undocumented = sorted(k for k, found in documented(statistics[kind]).items() if not found)
    assert undocumented == [], f"{kind} statistics not named (in backticks) in any docs/*.md: {undocumented}"


def test_statistics_tables_name_only_existing_keys(statistics):
    """The first column of every table headed `key` names keys that exist (no stale ones)."""
    every = set().union(*statistics.values())
    stale = []
    for page in DOCS:
        for table in re.findall(r"^\|[^\n]*\bkey\b[^\n]*\|\n\|[-| ]+\|\n((?:\|.*\n?)+)", text(page), flags=re.M):
            for row in table.splitlines():
                first = row.split("|")[1]
                for key in re.findall(r"`([\w*]+)`", first):
                    if "*" not in key and key not in every:
                        stale.append(f"{page.name}: {key}")
    assert stale == [], f"documented statistics that do not exist: {stale}"
