"""The benchmark scripts run end to end at toy sizes (`--smoke`: a tiny random model, a few seconds
each), print their tables with the method next to them, and leave docs/benchmarks.md alone.

The scripts are started together when the module begins (each is one single-threaded process in
smoke mode), so the module takes about as long as the slowest two of them."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs" / "benchmarks.md"
SCRIPTS = ["bench_reuse", "bench_tiers", "bench_paging", "bench_decode", "compile_table", "bench_block_size",
           "emulate_load", "bench_capacity"]
SWEEP = "emulate_load, target sweep"
COMMANDS = {SWEEP: ["emulate_load", "--slo-ttft", "0.5", "2"]}  # runs beyond each script's plain --smoke
RUNS = [*SCRIPTS, SWEEP]
NOT_WRITTEN = "(smoke run: docs/benchmarks.md not written)"


def start(run: str) -> subprocess.Popen:
    script, *extra = COMMANDS.get(run, [run])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU: the CPU paths, as CI runs them
    return subprocess.Popen([sys.executable, str(BENCH / f"{script}.py"), "--smoke", *extra], cwd=ROOT / "tests",
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(request):
    """The smoke runs of the scripts this session selected, started at once; docs bytes before."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "script" in item.callspec.params}
    before = DOCS.read_bytes() if DOCS.exists() else None
    processes = {script: start(script) for script in RUNS if script in selected}
    yield processes, before
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in `text`, as rows of cells (header first, separator dropped)."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|") and line.endswith("|"):
            current.append([cell.strip() for cell in line[1:-1].split("|")])
        elif current:
            found.append([row for row in current if not set("".join(row)) <= set("-:")])
            current = []
    return found


EXPECTED = {
    "bench_reuse": ["### Cross-request reuse", "**1. Support bot**", "PagedCache, warm pool (system prompt published)",
                    "transformers generate_batch", "tokens against per-request greedy `generate`",
                    "the pool's reservation (`bytes_total`)", "**2. Multi-turn chat**", "before every PagedCache run "
                    "the tenant is cleared", "**3. Documents**", "**4. Semantic index**"],
    "bench_tiers": ["### Pinning and tiers", "**1. Working set 3x the device pool**", "**2. Restart**", "**3. Churn**",
                    "same tokens as DynamicCache", "DynamicCache (no reuse)"],
    "bench_paging": ["### Paging on a left-padded batch", "PagedCache skips it",
                     "the pool's reservation (`bytes_total`)", "blocks in use (`bytes_used`)", "DynamicCache ms/step"],
    "bench_decode": ["### Decode on uniform rows at long context", "**1. Decode, pool with free space**",
                     "**2. Decode, fragmented pool**", "**3. Prefill and chunked prefill**",
                     "chunk after a cached 128-token prefix", "Above 1.05x:"],
    "compile_table": ["### Ahead-of-time compile for H100/H200", "registers/thread: sm_90, Triton",
                      "`paged_decode` split", "`paged_decode` merge", "`paged_prefill`", "`write_kv`", "<details>"],
    "bench_block_size": ["### Block size", "memory in partial blocks", "system prompt recomputed",
                         "the advisor's `block_overhead`", "Decision: a live pool keeps its block size"],
    "emulate_load": ["### Emulated tidal load: scheduling variants", "forwards paced to", "Not bench_load's figures",
                     "| on |", "| off |"],
    SWEEP: ["### Emulated tidal load: availability by time-to-first-token target", "SLO targets 0.5, 2 s",
            "configured with the target of the row"],
    "bench_capacity": ["### Capacity: sequences at once in the same memory", "| static reservation |",
                       "| ceiling (any system) |", "| engine, SGLang's rule alone |", "| transformers CB |"],
}
TABLE_COUNT = {"bench_reuse": 5, "bench_tiers": 3, "bench_paging": 3, "bench_decode": 3, "compile_table": 2,
               "bench_block_size": 1, "emulate_load": 1, SWEEP: 1, "bench_capacity": 1}


@pytest.mark.slow
@pytest.mark.parametrize("script", RUNS)
def test_smoke_run_prints_its_tables_and_leaves_the_docs_alone(runs, script):
    processes, docs_before = runs
    stdout, stderr = processes[script].communicate(timeout=600)
    assert processes[script].returncode == 0, stdout[-3000:] + stderr[-3000:]
    for text in EXPECTED[script]:
        assert text in stdout, text
    found = tables(stdout)
    assert len(found) == TABLE_COUNT[script], [t[0] for t in found]
    for table in found:
        assert len(table) >= 2 and all(len(row) == len(table[0]) for row in table), table  # well-formed rows
    if script not in ("compile_table", "bench_capacity"):  # bench_capacity: rounds of a setting, see check_figures
        assert stdout.count("Method: median of 3 runs") + stdout.count("Method: median of 5 runs") >= 1
        assert "FAILED" not in stdout
    assert NOT_WRITTEN in stdout
    assert (DOCS.read_bytes() if DOCS.exists() else None) == docs_before, "a smoke run wrote docs/benchmarks.md"
    check_figures(script, stdout)


def check_figures(script: str, out: str) -> None:
    """What each script's tables must show beyond their shape."""
    if script == "bench_decode":
        decode, fragmented, prefill = tables(out)
        assert len(decode) == len(fragmented) == 7 and len(prefill) == 7  # header + 3 points x fp32/bf16
        ratios = [row[5] for row in decode[1:] + fragmented[1:]] + [row[4] for row in prefill[1:]]
        assert all(re.fullmatch(r"(\*\*)?\d+\.\d{3}x(\*\*)?", ratio) for ratio in ratios), ratios
        fp32 = [row for row in decode[1:] + fragmented[1:] if row[0] == "fp32"]
        assert all(row[-2].split("/")[0] == row[-2].split("/")[1] for row in fp32), fp32  # argmax agrees
        # the fragmented pool really is fragmented: more than one run of blocks per row
        assert all(int(row[6].split("→")[0]) > 1 for row in fragmented[1:]), fragmented
    elif script == "bench_paging":
        assert re.search(r"\| PagedCache \| [\d.]+ \| [\d.]+x \| yes \|", out)
    elif script == "bench_reuse":
        assert "outputs identical" in out
        assert re.search(r"\| time to first token \| [\d.]+ \| [\d.]+ \| [\d.]+x \| \d+ \|", out)
    elif script == "bench_tiers":
        assert out.count("| yes |") >= 10  # every system of every workload matches DynamicCache
    elif script == "emulate_load":
        rows = tables(out)[0][1:]
        assert [row[1] for row in rows] == ["on", "off"] and len({row[0] for row in rows}) == 1  # the calibrated target
        assert all(re.fullmatch(r"\d+ / \d+ / \d+ of \d+", row[2]) for row in rows), rows  # every run listed
    elif script == SWEEP:
        rows = tables(out)[0][1:]
        assert [row[:2] for row in rows] == [["0.5", "on"], ["0.5", "off"], ["2", "on"], ["2", "off"]], rows
        assert all(re.fullmatch(r"\d+ / \d+ / \d+ of \d+", row[2]) for row in rows), rows
    elif script == "bench_capacity":
        assert "Method: 1 round after one untimed warm-up run" in out and "FAILED" not in out
        systems = [row for row in tables(out)[0][1:] if row[1] not in ("static reservation", "ceiling (any system)")]
        assert len(systems) == 6 and all(row[-1] == "yes" for row in systems if row[1].startswith("engine")), systems
        assert all(re.fullmatch(r"\d+ \(\d+\)", row[2]) and re.fullmatch(r"\d+\.\dx", row[3]) for row in systems)
    elif script == "compile_table":
        summary = tables(out)[0]
        assert [row[0] for row in summary[1:]] == ["`paged_decode` split", "`paged_decode` merge", "`paged_prefill`",
                                                   "`write_kv`"]


def private_accesses(path: Path) -> list[str]:
    """`x._name` where x is not self/cls (dunders are public)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", [*SCRIPTS, "common"])
def test_benchmarks_use_only_public_attributes(name):
    assert private_accesses(BENCH / f"{name}.py") == []


# ------------------------------------------------------------------- bench/run_all.py and the file

def run_all_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    return run_all


def run_all(*args: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU: the GPU steps are planned, and skipped
    done = subprocess.run([sys.executable, str(BENCH / "run_all.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def section_writers() -> list[str]:
    """The scripts in bench/ that write a section of docs/benchmarks.md (through common's `record`,
    `Checks.finish` or gpu_check's `write_docs`)."""
    return sorted(path.name for path in BENCH.glob("*.py") if path.name not in ("common.py", "run_all.py")
                  and re.search(r"\b(finish|record|write_docs)\(", path.read_text()))


def test_run_all_plans_every_script_that_writes_a_section(monkeypatch):
    writers = section_writers()
    assert {"bench_engine.py", "bench_load.py", "gpu_check.py", "tune_kernels.py", "compile_table.py"} <= set(writers)
    listed, dry = run_all("--list"), run_all("--dry-run")
    for script in writers:
        assert f"bench/{script}" in listed, script
        assert f"bench/{script}" in dry, script  # run, or skipped (GPU) with its sections kept
    assert "skipped (no CUDA): python bench/gpu_check.py" in dry and "python bench/tune_kernels.py;" in dry
    # every section of the file belongs to a step of the plan, so that a regeneration keeps it
    run_all_ = run_all_module(monkeypatch)
    markers = re.findall(r"^<!-- ([\w-]+) -->$", DOCS.read_text(), re.M)
    assert markers and set(markers) <= set(run_all_.SECTIONS), set(markers) - set(run_all_.SECTIONS)
    assert "drop none" in dry
    # --quick: every step with a quick form passes --quick (the sections say "quick mode") and fewer repeats
    quick = run_all("--list", "--quick")
    for step in run_all_.PLAN:
        if step.quick is not None:
            assert "--quick" in step.quick and step.command(True) in quick, step


def test_run_all_orders_sections_drops_the_rest_and_says_whether_it_is_one_snapshot(monkeypatch):
    run_all_ = run_all_module(monkeypatch)

    def section(name, commit, note=""):
        return (f"<!-- {name} -->\n### {name} (model)\n\ntext\n\nMeasured 2026-12-06 on CPU, 2 cores; torch x, code at "
                f"{commit}, with `python bench/x.py`{note}.\n<!-- /{name} -->")

    old = "\n\n".join(["# Benchmarks\n\nan old header", section("load", "abc"), "a paragraph outside any section",
                       section("what_changed", "abc"), section("bench_paging", "abc")])
    run = dict(command="python bench/run_all.py", date="2026-12-06", revision="abc", machine="CPU", ran=True)
    text, dropped = run_all_.arrange(old, run)
    assert dropped == ["what_changed"]
    assert text.index("<!-- bench_paging -->") < text.index("<!-- load -->")  # the plan's order
    assert "an old header" not in text and "outside any section" not in text
    assert "**One snapshot**" in text and "History lives in git" in text
    text, _ = run_all_.arrange(old.replace("code at abc", "code at def", 1), run)
    assert "**A composite, not one snapshot**" in text
    # quick figures are never taken for full ones
    marked = run_all_.mark_quick(section("load", "abc"), "load")
    assert "(quick mode)." in marked and run_all_.sections_of(marked)["load"].measured["quick"]
    text, _ = run_all_.arrange(marked, run)
    assert "| quick |" in text and "**Quick mode**" in text


def test_record_says_quick_mode_next_to_the_command(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    import common

    docs = tmp_path / "benchmarks.md"
    monkeypatch.setattr(common, "BENCHMARKS_MD", docs)
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_tiers.py"), "--quick", "--repeats", "1"])
    common.record("bench_tiers", "### Pinning and tiers\n\nbody")
    line = [line for line in docs.read_text().splitlines() if line.startswith("Measured")][0]
    assert "with `python bench/bench_tiers.py --quick --repeats 1` (quick mode" in line
    run_all_ = run_all_module(monkeypatch)
    assert run_all_.sections_of(docs.read_text())["bench_tiers"].measured["quick"]


def paragraphs(text: str) -> list[str]:
    """The prose of a markdown text: blocks between blank lines, each item of a list on its own;
    tables, code and HTML comments left out (a table is data, not a paragraph)."""
    found = []
    for block in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", text, flags=re.S)):
        lines = [line for line in block.splitlines() if not re.fullmatch(r"\s*<!--.*-->\s*", line)]
        if not lines or all(line.startswith("|") for line in lines):
            continue
        item = []
        for line in lines:
            if re.match(r"\s*([-*]|\d+\.) ", line) and item:
                found.append("\n".join(item))
                item = []
            item.append(line)
        found.append("\n".join(item))
    return found


def test_no_paragraph_of_the_benchmarks_is_over_1500_characters():
    prose = paragraphs(DOCS.read_text())
    assert len(prose) > 50
    long = [f"{len(p)} characters: {p[:120]}" for p in prose if len(p) > 1500]
    assert long == []
