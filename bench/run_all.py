"""Regenerate docs/benchmarks.md as one snapshot: run every benchmark script that writes a section,
then rewrite the file's header (commit, date, machine, the list of sections) and put the sections
in a fixed order.

    python bench/run_all.py                  # every script, full runs (hours on a 2-core CPU)
    python bench/run_all.py --quick          # sizes cut for a 2-core CPU; sections say "quick mode"
    python bench/run_all.py --only engine load
    python bench/run_all.py --list           # the plan: steps, sections, commands
    python bench/run_all.py --dry-run        # what would run, be skipped, kept and dropped; writes nothing
    python bench/run_all.py --rewrite        # run nothing: only the header and the order of the sections

Each step is one script run as a subprocess from the repository root with the arguments its
section's "Measured ... with `...`" line states; the script rewrites its own section (between
`<!-- name -->` markers, `bench/common.py`'s `record`). A step that fails leaves its section as it
was, and the header then lists it with its own older commit. GPU-only steps (`gpu_check.py`,
`tune_kernels.py`) are skipped on a machine without CUDA: their sections stay as they are, with the
date, hardware and commit they state, and the header says so.

After the steps, the file is rebuilt: the header, then the sections of the plan in the plan's order.
Sections that no step writes any more are dropped, as is any text outside a section: history lives
in git (`git log -p docs/benchmarks.md`), not in the file.

`--quick` passes each script reduced arguments (`--repeats 1`, fewer requests or steps) and
`--quick`, which lets a script record fewer than 3 repeats and makes `record` put "quick mode" next
to the command, so that quick figures are never mistaken for full ones. Steps without a quick form
(the compile table, the GPU scripts) run as in a full run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS_ENV = "HF_PAGED_KV_BENCHMARKS_MD"  # where bench/common.py's record writes (default docs/benchmarks.md)
QUICK_NOTE = "quick mode"  # what a quick run's sections say next to their command (bench/common.py)


@dataclass(frozen=True)
class Step:
    name: str  # for --only
    script: str  # a file in bench/
    sections: tuple[str, ...]  # the markers it writes
    full: tuple[str, ...] = ()  # the full run's arguments: the command its sections state
    quick: tuple[str, ...] | None = None  # --quick's arguments; None: the full run is small already
    gpu: bool = False  # needs CUDA: skipped (its sections kept) on a machine without one

    def arguments(self, quick: bool) -> tuple[str, ...]:
        return self.quick if quick and self.quick is not None else self.full

    def command(self, quick: bool) -> str:
        return shlex.join(["python", f"bench/{self.script}", *self.arguments(quick)])


R1 = ("--quick", "--repeats", "1")
# The order of the steps is the order of the sections in docs/benchmarks.md: the cache alone, reuse
# and tiers, the block size, then serving (engine, capacity, load and its emulations), then kernels.
PLAN = [
    Step("paging", "bench_paging.py", ("bench_paging",), ("--repeats", "3"), (*R1, "--new-tokens", "16")),
    Step("decode", "bench_decode.py", ("bench_decode",), (), (*R1, "--steps", "4")),
    Step("grammar", "bench_grammar.py", ("bench_grammar",), (), R1),
    Step("reuse", "bench_reuse.py", ("bench_reuse",), (), (*R1, "--questions", "8")),
    Step("reuse_support_1500", "bench_reuse.py", ("bench_reuse_support_1500",),
         ("--support-only", "--system-tokens", "1500"),
         (*R1, "--support-only", "--system-tokens", "1500", "--questions", "8")),
    Step("tiers", "bench_tiers.py", ("bench_tiers",), (), R1),
    Step("block_size", "bench_block_size.py", ("block_size",), (), R1),
    Step("engine", "bench_engine.py", ("engine",), (), (*R1, "--requests", "24", "--rates", "2,inf")),
    Step("clients", "bench_clients.py", ("bench_clients",), (), (*R1, "--requests", "8")),
    Step("capacity", "bench_capacity.py", ("capacity",), (), R1),
    Step("load", "bench_load.py", ("load",), ("--repeats", "3"), (*R1, "--minutes", "1")),
    Step("emulated_load", "emulate_load.py", ("emulated-load",),
         ("--slo-ttft", "0.49", "--slo-per-token", "0.28", "--variants", "on", "off", "rules-only",
          "no-partial-rule", "no-burst", "--repeats", "3", "--parallel", "4"),
         (*R1, "--slo-ttft", "0.49", "--slo-per-token", "0.28", "--variants", "on", "off", "--parallel", "2")),
    Step("emulated_load_targets", "emulate_load.py", ("emulated-load-targets",),
         ("--slo-ttft", "0.49", "0.7", "1.0", "1.3", "--slo-per-token", "0.28", "--repeats", "3", "--parallel", "4"),
         (*R1, "--slo-ttft", "0.49", "1.3", "--slo-per-token", "0.28", "--parallel", "2")),
    Step("ablation", "ablation.py", ("ablation",), (),
         (*R1, "--variants", "all rules", "core", "--parallel", "2")),
    Step("ablation_overload", "ablation.py", ("ablation-overload",),
         ("--traces", "overload", "--variants", "all rules", "core", "no-shedding", "no-overload"),
         (*R1, "--traces", "overload", "--variants", "all rules", "no-shedding", "--parallel", "2")),
    Step("compile_table", "compile_table.py", ("compile_table",)),
    Step("gpu_check", "gpu_check.py", ("gpu_check",), ("--budget", "360"), gpu=True),
    Step("tune_kernels", "tune_kernels.py", ("kernel_tiles",), gpu=True),
]
SECTIONS = [section for step in PLAN for section in step.sections]

SECTION = re.compile(r"<!-- ([\w-]+) -->\n.*?<!-- /\1 -->", re.S)
MEASURED = re.compile(r"^Measured (\S+) on (.+?), code at (\S+), with `([^`]+)`(.*)$", re.M)


# ------------------------------------------------------------------------------ machine

def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def revision() -> str:
    """HEAD's short hash, +dirty when code has uncommitted changes (docs/ does not count), as
    bench/common.py's `revision` stamps each section."""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs") else "")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The CUDA device's name, None without one (imports torch: only when steps run or are planned)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def machine(gpu: str | None) -> str:
    return (f"{cpu_model()}, {os.cpu_count()} cores; {gpu or 'no GPU'}; Python {platform.python_version()}, "
            f"torch {version('torch')}, transformers {version('transformers')}, triton {version('triton')}")


# ------------------------------------------------------------------------------ the file

@dataclass
class Section:
    name: str
    text: str

    @property
    def heading(self) -> str:
        found = re.search(r"^#+ (.+)$", self.text, re.M)
        return found.group(1).strip() if found else self.name

    @property
    def title(self) -> str:
        """The heading without its closing parenthesis (model, dtype, hardware: the table says them)."""
        return re.sub(r"\s*\([^()]*(\([^()]*\)[^()]*)*\)$", "", self.heading) or self.heading

    @property
    def measured(self) -> dict | None:
        found = list(MEASURED.finditer(self.text))
        if not found:
            return None
        date, where, commit, command, rest = found[-1].groups()
        return dict(date=date, machine=where, commit=commit, command=command, quick=QUICK_NOTE in rest)


def sections_of(text: str) -> dict[str, Section]:
    return {m.group(1): Section(m.group(1), m.group(0)) for m in SECTION.finditer(text)}


def step_of(section: str) -> Step:
    return next(step for step in PLAN if section in step.sections)


def header(found: dict[str, Section], run: dict) -> str:
    """The file's header: what the last run of this script did, whether the sections form one
    snapshot, and the list of sections with where each comes from."""
    lines = ["# Benchmarks", ""]
    if run["ran"]:
        lines += [f"Written by `{run['command']}` on {run['date']}, code at {run['revision']}"
                  f"{' (uncommitted changes outside docs/)' if run['revision'].endswith('+dirty') else ''}, on "
                  f"{run['machine']}.", ""]
    else:
        lines += [f"Arranged by `{run['command']}` on {run['date']} at {run['revision']}: no benchmark ran then, "
                  "so each section is as its own run left it.", ""]
    commits = {s.measured["commit"] for s in found.values() if s.measured}
    quick = [name for name, s in found.items() if s.measured and s.measured["quick"]]
    if len(commits) == 1 and commits == {run["revision"]} and run["ran"]:
        lines += [f"**One snapshot**: every section below was measured by this run, at {run['revision']}."]
    else:
        lines += ["**A composite, not one snapshot**: the sections below were measured at different commits, on "
                  "different days, some on other hardware; each section's last line says when, where, at which "
                  "commit and with which command. The next full `python bench/run_all.py` regenerates the file as "
                  "one snapshot."]
    lines += ["", "- Each section was printed and written here by its script (run from the repository root with the "
                  "project's `.venv`); each ratio compares figures measured in the same run.",
              "- CPU figures come from a shared 2-core machine: expect a few percent of run-to-run variation. "
              "Targets from the issues are quoted next to the figures, met or not.",
              "- GPU sections (`gpu_check.py`, `tune_kernels.py`) run only where CUDA is available; elsewhere "
              "`run_all.py` keeps them as they are, with their own date, hardware and commit.",
              "- History lives in git (`git log -p docs/benchmarks.md`): this file holds only the latest run of each "
              "section, with nothing about earlier figures."]
    if quick:
        lines += [f"- **Quick mode** (`--quick`, sizes cut for a 2-core CPU) wrote {len(quick)} of the sections "
                  "(marked \"quick mode\" next to their command): their figures are not comparable with a full run's."]
    rows = []
    for name, s in found.items():
        m = s.measured or {}
        rows.append(f"| {s.title} | `bench/{step_of(name).script}` | {m.get('date', '?')} | "
                    f"{m.get('commit', '?')} | {m.get('machine', '?').split(';')[0]} |"
                    f" {'quick' if m.get('quick') else 'full'} |")
    lines += ["", "| section | script | measured | code at | hardware | run |", "|---|---|---|---|---|---|", *rows]
    return "\n".join(lines)


def arrange(text: str, run: dict) -> tuple[str, list[str]]:
    """The file rebuilt: header, then the plan's sections in the plan's order. Returns the new text
    and the names of the sections dropped (written by no step of the plan)."""
    found = sections_of(text)
    kept = {name: found[name] for name in SECTIONS if name in found}
    dropped = [name for name in found if name not in kept]
    body = "\n\n".join(s.text for s in kept.values())
    return header(kept, run) + "\n\n" + body + "\n", dropped


def mark_quick(text: str, section: str) -> str:
    """Say "quick mode" next to the command of `section` where its writer did not."""
    found = sections_of(text).get(section)
    if found is None or (found.measured or {}).get("quick"):
        return text
    marked = MEASURED.sub(lambda m: m.group(0).rstrip(".") + f" ({QUICK_NOTE}).", found.text)
    return text.replace(found.text, marked)


# ------------------------------------------------------------------------------ main

def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes cut for a 2-core CPU (sections say quick mode)")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[step.name for step in PLAN],
                        help="run only these steps (the other sections are kept as they are)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run, be skipped, kept and dropped; write nothing")
    parser.add_argument("--rewrite", action="store_true", help="run nothing: rewrite the header and order only")
    parser.add_argument("--docs", type=Path, default=None,
                        help=f"the file to rewrite (default docs/benchmarks.md; passed to the scripts as ${DOCS_ENV})")
    return parser.parse_args(argv)


def print_plan(quick: bool, cuda: bool | None) -> None:
    for step in PLAN:
        where = "needs CUDA" + ("" if cuda is None else (": runs" if cuda else ": skipped, no CUDA here")) \
            if step.gpu else "CPU"
        mode = " (no quick form: as in a full run)" if quick and step.quick is None else ""
        print(f"{step.name:24s} {', '.join(step.sections):28s} [{where}] {step.command(quick)}{mode}")


def main(argv=None) -> int:
    args = parse(argv)
    docs = (args.docs or Path(os.environ.get(DOCS_ENV, ROOT / "docs" / "benchmarks.md"))).resolve()
    if args.list:
        print_plan(args.quick, None)
        return 0
    steps = [] if args.rewrite else [step for step in PLAN if not args.only or step.name in args.only]
    gpu = gpu_name() if any(step.gpu for step in steps) or not args.rewrite else None
    missing = [step for step in steps if not (BENCH / step.script).exists()]
    todo = [step for step in steps if (gpu or not step.gpu) and step not in missing]
    skipped = [step for step in steps if step not in todo and step not in missing]
    for step in missing:
        print(f"skipped {step.name}: bench/{step.script} is not in this tree", file=sys.stderr)
    run = dict(command=shlex.join(["python", "bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
               date=datetime.date.today().isoformat(), revision=revision(), machine=machine(gpu), ran=bool(todo))
    if args.dry_run:
        print_plan(args.quick, gpu is not None)
        print(f"\nwould run {len(todo)} step(s) from {ROOT}, writing {docs}:")
        for step in todo:
            print(f"  {step.command(args.quick)}")
        for step in skipped:
            print(f"  skipped (no CUDA): {step.command(args.quick)}; its sections are kept as they are")
        text = docs.read_text() if docs.exists() else "# Benchmarks\n"
        _, dropped = arrange(text, run)
        found = sections_of(text)
        print(f"then keep {len([s for s in SECTIONS if s in found])} section(s) in the plan's order; "
              f"drop {dropped or 'none'} (no step writes them) and any text outside a section")
        return 0
    env = dict(os.environ, **{DOCS_ENV: str(docs)})
    failed = []
    for i, step in enumerate(todo, 1):
        command = [sys.executable, str(BENCH / step.script), *step.arguments(args.quick)]
        print(f"[{i}/{len(todo)}] {step.command(args.quick)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, env=env).returncode
        print(f"[{i}/{len(todo)}] {step.name}: exit {code} after {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        if code:
            failed.append(step.name)
        elif args.quick and step.quick is not None and docs.exists():
            text = docs.read_text()
            for section in step.sections:
                text = mark_quick(text, section)
            docs.write_text(text)
    for step in skipped:
        print(f"skipped {step.name} (no CUDA here): its section is kept as it is", file=sys.stderr)
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    text, dropped = arrange(text, run)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    if dropped:
        print(f"dropped sections no step writes: {', '.join(dropped)}", file=sys.stderr)
    if failed:
        print(f"FAILED steps (their sections left as they were): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
