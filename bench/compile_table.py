"""The ahead-of-time compile table of docs/benchmarks.md, generated: runs the kernels' compile check
for sm_90 (H100/H200) and sm_80 (A100) with the venv's Triton and, when `.venv/triton-3.6` exists,
with Triton 3.6 (the GPU machines' release), and records the table those runs print.

    python bench/compile_table.py            # every variant, both targets, both Triton releases
    python bench/compile_table.py --smoke    # `--quick` variants, sm_90, the venv's Triton; prints only

Each run is `python -m hf_paged_kv.kernels.compile_check --arch N` in a subprocess: without
`TRITON_INTERPRET` (the interpreter replaces the compiler), from a scratch directory (the
repository's `./kernels` must not shadow the Hugging Face `kernels` package), with Triton 3.6 put
first on `PYTHONPATH` for the 3.6 runs, and (full runs) an empty Triton cache, so that every
variant is compiled now. A run that fails exits 1 and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from common import ROOT, markdown_table, note, record

KERNEL_ORDER = ["decode_split_kernel", "merge_splits_kernel", "prefill_kernel", "write_kv_kernel"]
TITLES = {"decode_split_kernel": "`paged_decode` split", "merge_splits_kernel": "`paged_decode` merge",
          "prefill_kernel": "`paged_prefill`", "write_kv_kernel": "`write_kv`"}
VARIANT_KEYS = ("kernel", "dtype", "head_dim", "group", "block", "splits")
HAND_WRITTEN = r"### Ahead-of-time compile for H100/H200.*?(?=What the check found and changed|<!-- )"


def triton_36() -> Path | None:
    for candidate in (ROOT / ".venv" / "triton-3.6", Path(sys.prefix) / "triton-3.6"):
        if candidate.is_dir():
            return candidate
    return None


def run_check(arch: int, triton_path: Path | None, quick: bool, fresh_cache: bool) -> dict:
    """One compile check: {"triton": version, "arch": arch, "rows": [dict per variant]}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")
    if triton_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(triton_path), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "hf_paged_kv.kernels.compile_check", "--arch", str(arch)]
    command += ["--quick"] if quick else []
    with tempfile.TemporaryDirectory() as scratch:
        if fresh_cache:
            env["TRITON_CACHE_DIR"] = str(Path(scratch) / "triton-cache")
        result = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    header, columns, *lines = result.stdout.strip().splitlines()
    names = columns.split()
    rows = [dict(zip(names, line.split())) for line in lines]
    version = header.split(",")[0].removeprefix("triton ").strip()
    return {"triton": version, "arch": arch, "rows": rows, "header": header}


def label(run: dict) -> str:
    return f"sm_{run['arch']}, Triton {run['triton']}"


def summary(runs: list[dict]) -> str:
    """One row per kernel: variants, register range per run, shared memory and spills over all runs."""
    header = ["kernel", "variants"] + [f"registers/thread: {label(r)}" for r in runs] + ["shared memory, max", "spills"]
    rows = []
    kernels = sorted({row["kernel"] for r in runs for row in r["rows"]},
                     key=lambda k: KERNEL_ORDER.index(k) if k in KERNEL_ORDER else len(KERNEL_ORDER))
    for kernel in kernels:
        per_run = [[row for row in r["rows"] if row["kernel"] == kernel] for r in runs]
        counts = sorted({len(rows_) for rows_ in per_run})
        cells = []
        for rows_ in per_run:
            registers = [int(row["registers"]) for row in rows_]
            cells.append(f"{min(registers)}-{max(registers)}" if registers and min(registers) != max(registers)
                         else (str(registers[0]) if registers else "-"))
        shared = max(int(row["shared_bytes"]) for rows_ in per_run for row in rows_)
        spills = sum(int(row["spill_bytes"]) for rows_ in per_run for row in rows_)
        spilling = sum(1 for rows_ in per_run for row in rows_ if int(row["spill_bytes"]))
        rows.append([TITLES.get(kernel, kernel), "/".join(map(str, counts)), *cells, f"{shared:,} B",
                     "0" if not spills else f"**{spilling} variants, {spills:,} B**"])
    return markdown_table(header, rows)


def details(runs: list[dict]) -> str:
    """Every variant: registers (spilled bytes when any) per run, shared memory per run."""
    table = defaultdict(dict)
    for index, run in enumerate(runs):
        for row in run["rows"]:
            key = tuple(row[k] for k in VARIANT_KEYS)
            spill = int(row["spill_bytes"])
            table[key][index] = (row["registers"] + (f" (spills {spill} B)" if spill else ""), row["shared_bytes"])
    header = [*VARIANT_KEYS] + [f"registers: {label(r)}" for r in runs] + ["shared bytes (per run)"]
    rows = []
    def order(key):
        kernel, dtype, *numbers = key
        return KERNEL_ORDER.index(kernel) if kernel in KERNEL_ORDER else 9, dtype, *map(int, numbers)

    for key in sorted(table, key=order):
        cells = [table[key].get(i, ("-", "-")) for i in range(len(runs))]
        shared = sorted({c[1] for c in cells if c[1] != "-"})
        rows.append([*key, *(c[0] for c in cells), "/".join(shared)])
    return markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="--quick variants, sm_90, the venv's Triton; prints only")
    args = parser.parse_args(argv)
    releases = [None]  # None: the venv's Triton
    missing_36 = False
    if not args.smoke:
        path_36 = triton_36()
        missing_36 = path_36 is None
        releases += [path_36] if path_36 else []
    archs = [90] if args.smoke else [90, 80]
    runs = []
    try:
        for triton_path in releases:
            for arch in archs:
                release = f"Triton 3.6 ({triton_path})" if triton_path else "the venv's Triton"
                note(f"compile check: sm_{arch}, {release}")
                runs.append(run_check(arch, triton_path, quick=args.smoke, fresh_cache=not args.smoke))
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"FAILED (nothing written to docs/benchmarks.md): {error}")
        return 1
    variants = "the `--quick` variants (bf16/fp32 x head dims 64/96)" if args.smoke else (
        "fp32/fp16/bf16 x head dims 64/96/128 (GQA group 4, block size 16, 1 and 4 decode splits), then bf16 head dim 128 "
        "with GQA groups 1/5/7, block sizes 32/64 and 3/64 decode splits; prefill on the GPU tiles of `prefill_tiles`")
    runs_said = "; ".join(f"`{r['header']}`" for r in runs)
    note_36 = ("\n\nTriton 3.6 is not installed here (`.venv/triton-3.6`, see scripts/bootstrap.sh): only the venv's "
               "Triton was checked." if missing_36 else "")
    body = (
        "### Ahead-of-time compile for H100/H200 (sm_90) and A100 (sm_80), no GPU needed\n\n"
        "`python -m hf_paged_kv.kernels.compile_check --arch N` builds each launch exactly as the wrappers do "
        "(on `meta` tensors), specializes it with Triton's launcher rules and compiles it with Triton's NVIDIA "
        "backend to a cubin; `ptxas -v` (shipped with Triton) gives registers and spills.\n\n"
        f"Variants: {variants}; launches that compile to the same source are counted once.\n\n"
        f"Runs: {runs_said}. Every variant compiled in every run (a failure would have stopped this table)."
        f"{note_36}\n\n{summary(runs)}\n\n"
        "<details><summary>Every variant</summary>\n\n" + details(runs) + "\n\n</details>"
    )
    record("compile_table", body, write=not args.smoke, replaces=HAND_WRITTEN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
