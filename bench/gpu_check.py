"""GPU check: the Triton kernels and the CUDA paths of hf_paged_kv, checked and timed in one run
of a few minutes (meant to stay well under ten on an H100/H200).

On a GPU machine without network, from the source tree (`python3` being the interpreter that has
torch, triton and transformers):

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . \\
        && PYTHONPATH=/tmp/site python3 bench/gpu_check.py

Progress goes to stderr with timestamps as it runs (so a run cut short still shows where it
was); the table goes to stdout at the end and, only when every check passed, into its section of
docs/benchmarks.md (copy that file back from the machine). When any check fails, the failures are
listed at the end, the exit status is 1 and nothing is written. `--revision REV` names the commit
in the docs when the machine's copy of the tree has no git history; `--budget SECONDS` (default
450) skips what has not started once that much time has passed, which counts as a failure.

1. `tests/test_kernels.py` on CUDA (every kernel against the torch reference), in a subprocess;
2. decode with Llama-8B-like heads (32 query, 8 KV, dim 128, bf16) at batch 1/32/128 and context
   1k/8k/32k, against `scaled_dot_product_attention` on the same KV stored contiguously (native
   GQA, math kernel excluded), and as a share of a device-to-device copy's bandwidth;
3. prefill against SDPA: `is_causal` without a mask when there is no cached prefix, K/V heads
   expanded before the timed region and a bottom-right causal mask when there is one;
   every row of 2 and 3 checks both outputs against fp32 attention on the same inputs, with an
   explicit tolerance, and times both sides with `triton.testing.do_bench` (median) in rounds of
   alternating order, reporting the median of the rounds;
4. end to end, SmolLM2-135M (its config with random weights when the GGUF package is missing):
   greedy tokens of `PagedCache` (Triton) equal `DynamicCache`'s in fp32 on a left-padded batch;
   in bf16 the logit difference is measured and set beside the one between two of transformers'
   own attention implementations; then `generate` throughput, `PagedCache(reuse=False)` against
   `DynamicCache`, fresh prompts every round, order alternated, checked to do the same work;
5. the host tier's CUDA path: a prompt's blocks pushed to page-locked host memory by pool
   pressure come back on the side stream bit-exact, also into blocks that a kernel still queued
   on the forward stream writes (with a control that skips the wait, to show the check can
   fail); time to first token of a host-tier hit against recomputing and against a device hit.

`--smoke` runs every step at toy sizes on the CPU (Triton interpreter, wall-clock timer instead
of do_bench) so the script itself is tested where no GPU is (tests/test_gpu_check_script.py).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before Triton is imported: main() is too late
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import re
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache
from hf_paged_kv.integration.hooks import state_of

try:
    import common  # bench/common.py; it asks git for the revision when imported
except OSError as error:  # no git binary on the machine: write the docs section here instead
    common, COMMON_ERROR = None, error

ROOT = Path(__file__).resolve().parent.parent

# ‖out - ref‖ / ‖ref‖ against fp32 attention on the same (upcast) inputs. bf16: the kernels round
# the softmax weights and the output to bf16 (about 2e-3 expected); fp32 lands far below 1e-5.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# fp32 end to end: max |logit difference| / max |logit| over the steps whose inputs are identical.
FP32_LOGIT_TOLERANCE = 1e-3
FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
DO_BENCH = dict(warmup=25, rep=100)  # milliseconds
JUNK = 7.0  # what the straggling kernel writes: finite, and unlike any K/V the model computes
STRAGGLER_CYCLES = 200_000_000  # GPU clock cycles the straggler sleeps first (~0.1 s at 2 GHz)
RANDOM_INIT = 0.05  # weight scale of the random SmolLM2: the default 0.02 repeats a few tokens


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="GPU check: Triton kernels, end to end, host tier")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, to test this script")
    parser.add_argument("--skip-tests", action="store_true", help="skip step 1 (kernel tests on CUDA)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which steps not yet started are skipped (default 450; none with --smoke)")
    parser.add_argument("--revision", default=None, help="the commit to name in docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    sizes = Sizes(args.smoke)
    budget = args.budget if args.budget is not None else (float("inf") if args.smoke else 450.0)
    run = Run(args.smoke, budget)
    run.log(f"start on {machine_name(sizes.device)}")
    models = Models(run, sizes)
    sections = []
    if args.smoke or args.skip_tests:
        reason = "--smoke" if args.smoke else "--skip-tests"
        sections.append(f"Kernel tests on CUDA (`tests/test_kernels.py`): not run ({reason})")
    else:
        sections.append(run.section("Kernel tests", kernel_tests))
    sections.append(run.section("Decode", decode_section, sizes))
    sections.append(run.section("Prefill", prefill_section, sizes))
    sections.append(run.section("End to end", end_to_end_section, sizes, models))
    sections.append(run.section("Host tier", host_tier_section, sizes, models))
    verdict = (f"All {run.passed} checks passed." if not run.failures
               else f"{len(run.failures)} of {run.passed + len(run.failures)} checks FAILED.")
    body = (f"### GPU check on {machine_name(sizes.device)}\n\n" + "\n\n".join(sections)
            + f"\n\n{verdict} Total time {run.elapsed():.0f} s.")
    if run.failures:
        print(body)
        report = "FAILED CHECKS (nothing written to docs/benchmarks.md):\n" + "\n".join(f"- {f}" for f in run.failures)
        print("\n" + report)
        print(report, file=sys.stderr)
        return 1
    if args.smoke:
        print(body)
    else:
        write_docs(body, args.revision)
    run.log("done")
    return 0


# ---------------------------------------------------------------------------- bookkeeping
class Run:
    """Checks, progress on stderr and the time budget of one run."""

    def __init__(self, smoke: bool, budget: float):
        self.smoke, self.budget = smoke, budget
        self.start = time.monotonic()
        self.passed = 0
        self.failures: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)

    def check(self, ok, what: str) -> bool:
        """Count a check; a failed one is listed at the end (and fails the run)."""
        ok = bool(ok)
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
            self.log(f"CHECK FAILED: {what}")
        return ok

    def out_of_time(self, what: str) -> bool:
        if self.elapsed() < self.budget:
            return False
        self.check(False, f"{what}: not run, the time budget of {self.budget:.0f} s was spent")
        return True

    def section(self, title: str, fn, *args) -> str:
        """Run one step; an exception fails the run but not the steps after it."""
        if self.out_of_time(title):
            return f"{title}: NOT RUN (time budget spent)"
        self.log(f"{title}: start")
        try:
            body = fn(self, *args)
        except Exception as error:  # report it, go on with the next step
            self.log(traceback.format_exc())
            self.check(False, f"{title} raised {type(error).__name__}: {error}")
            body = f"{title}: FAILED ({type(error).__name__}: {error})"
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.log(f"{title}: done\n{body}")
        return body


class Sizes:
    """Shapes: the issue's on a GPU, toy ones for --smoke."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.block_size = 16
        self.rounds = 2 if smoke else 3  # timing rounds, order alternated (rotated)
        self.kernel_dtype = torch.float32 if smoke else torch.bfloat16
        self.speed_dtype = torch.float32 if smoke else torch.bfloat16  # end-to-end timings
        self.heads, self.kv_heads, self.head_dim = (4, 2, 64) if smoke else (32, 8, 128)
        self.batches = (1, 2) if smoke else (1, 32, 128)
        self.contexts = (70,) if smoke else (1024, 8192, 32768)
        self.prefill = [(1, 48, 0), (2, 32, 16)] if smoke else [(1, 4096, 0), (8, 1024, 0), (4, 1024, 4096)]
        self.copy_bytes = 1 << 20 if smoke else 4 << 30
        self.layers = 2 if smoke else 30
        self.pool_blocks = 64 if smoke else 4096
        self.e2e = [(1, 16, 2)] if smoke else [(1, 256, 128), (16, 256, 128)]  # (batch, prompt, new tokens)
        self.fp32_lengths = [16, 11] if smoke else [256, 200, 131, 77]  # left-padded fp32 equality batch
        self.fp32_new = 3 if smoke else 32
        self.bf16_report = (1, 16, 2) if smoke else (4, 256, 64)  # (batch, prompt, new) for logit errors
        self.tier_prompt = 32 if smoke else 4096  # whole blocks; the request adds 8 more tokens


def machine_name(device: str) -> str:
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run, Triton interpreter)"
    return f"{name} (torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__})"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_docs(body: str, revision: str | None, section: str = "gpu_check") -> None:
    """Store `body` in docs/benchmarks.md (bench/common.py's `record`, or the same format when
    common could not be imported because the machine has no git)."""
    if common is not None:
        if revision:
            common.REVISION = revision
        common.record(section, body)
        return
    print(f"(bench/common.py not importable: {COMMON_ERROR}; writing the section here)", file=sys.stderr)
    path = ROOT / "docs" / "benchmarks.md"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    block = (f"<!-- {section} -->\n{body}\n\nMeasured {datetime.date.today().isoformat()} on {device}, code at "
             f"{revision or 'unknown'}, with `{command}`.\n<!-- /{section} -->")
    print(body)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- {section} -->.*?<!-- /{section} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)


# ------------------------------------------------------------------------------- timing
def timed(fn, smoke: bool) -> float:
    """Median milliseconds of `fn` (already warmed up): do_bench on the GPU, a plain timer under
    the interpreter (do_bench crashes there)."""
    if smoke:  # one call: the interpreter is slow, and these figures mean nothing anyway
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median", **DO_BENCH)


def compare_times(systems: dict, rounds: int, smoke: bool) -> dict[str, float]:
    """`systems`: name -> (fn, context factory for the timed region). Each round times every
    system once, the order rotated from round to round; returns each one's median over rounds."""
    names = list(systems)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn, context = systems[name]
            with context():
                times[name].append(timed(fn, smoke))
    return {name: statistics.median(t) for name, t in times.items()}


METHOD = ("each side timed by `triton.testing.do_bench` (median; {warmup} ms warm-up, {rep} ms of calls, L2 "
          "flushed before each) in {rounds} rounds of alternating order; the median of the rounds")


def method(sizes: Sizes) -> str:
    if sizes.smoke:
        return f"wall clock, one call per round, {sizes.rounds} rounds of alternating order (smoke run)"
    return METHOD.format(rounds=sizes.rounds, **DO_BENCH)


# ------------------------------------------------------------------- step 1: kernel tests
def kernel_tests(run: Run) -> str:
    title = "Kernel tests on CUDA (`tests/test_kernels.py`)"
    if importlib.util.find_spec("pytest") is None:
        return (f"{title}: NOT RUN, pytest is not installed here (carry its wheels: DEVELOPERS.md, GPU checks); "
                "the kernel tables below still check every output")
    limit = max(60.0, min(300.0, run.budget - run.elapsed() - 200.0))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_kernels.py")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        result = subprocess.run(command, cwd=ROOT / "tests", capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        run.log(out[-3000:])
        run.check(False, f"kernel tests did not finish within {limit:.0f} s")
        return f"{title}: FAILED (no result within {limit:.0f} s)"
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    run.log(result.stdout[-4000:] + result.stderr[-2000:])
    ok = run.check(result.returncode == 0, f"kernel tests on CUDA: exit {result.returncode}: {summary}")
    return f"{title}: {'passed' if ok else f'FAILED (exit {result.returncode})'}: {summary}"


# ------------------------------------------------------------------- steps 2-3: kernels
def random_paged_kv(batch: int, context: int, sizes: Sizes, dtype):
    """A pool holding `batch` rows of `context` tokens in shuffled blocks, and the same KV
    contiguous `[batch, kv_heads, context, head_dim]`."""
    device, block = sizes.device, sizes.block_size
    blocks_per_row = -(-context // block)
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, block, sizes.kv_heads, sizes.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    flat = (tables.long()[:, :, None] * block + torch.arange(block, device=device)).flatten(1)[:, :context]
    contiguous = [c.view(-1, sizes.kv_heads, sizes.head_dim)[flat].transpose(1, 2).contiguous()
                  for c in (key_cache, value_cache)]
    return key_cache, value_cache, tables, lens, contiguous


@dataclass
class Baseline:
    fn: object  # the timed SDPA call
    label: str
    context: object  # context factory for the timed region (the SDPA kernels allowed)


def fast_sdpa(query, keys, values, scale, mask=None, causal=False) -> Baseline:
    """The SDPA baseline on contiguous KV in its fastest form: native GQA without a mask, else
    K/V heads expanded here (outside any timed region); on CUDA the math kernel is excluded, so
    a form no fast kernel accepts is noticed (then the next form, and the math kernel only as a
    labelled last resort)."""
    groups = query.shape[1] // keys.shape[1]
    restricted = (lambda: sdpa_kernel(FAST_SDPA)) if query.is_cuda else contextlib.nullcontext
    forms = []
    if mask is None:
        forms.append(("native GQA", lambda: lambda: F.scaled_dot_product_attention(
            query, keys, values, is_causal=causal, scale=scale, enable_gqa=groups > 1)))

    def expanded():
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (keys, values))
        return lambda: F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=causal, scale=scale)

    forms.append(("K/V heads expanded", expanded))
    for label, build in forms:
        fn = build()
        try:
            with restricted():
                fn()
        except RuntimeError as error:
            print(f"SDPA form '{label}' has no fast kernel here ({str(error)[:200]}); next form", file=sys.stderr)
            continue
        return Baseline(fn, label + (", math kernel excluded" if query.is_cuda else ""), restricted)
    # `fn` is the last form, the expanded one
    return Baseline(fn, "K/V heads expanded, MATH KERNEL (no fast kernel accepted)", contextlib.nullcontext)


def reference_attention(query, keys, values, scale, mask=None, causal=False, rows: int = 8):
    """fp32 attention on the upcast inputs (math kernel, a few rows at a time)."""
    out = []
    with sdpa_kernel([SDPBackend.MATH]):
        for lo in range(0, query.shape[0], rows):
            q, k, v = (t[lo : lo + rows].float() for t in (query, keys, values))
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                      enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(out)


def relative_error(out, ref) -> float:
    """‖out - ref‖ / ‖ref‖ (NaN when out has a NaN or an unwritten element)."""
    return ((out.float() - ref).norm() / ref.norm()).item()


def judge(run: Run, what: str, errors: dict[str, float], tolerance: float) -> str:
    ok = all(e <= tolerance for e in errors.values())  # False for NaN
    run.check(ok, f"{what}: relative error " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
              + f" (tolerance {tolerance:.0e})")
    return "ok" if ok else "FAILED"


def copy_bandwidth(sizes: Sizes) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (sizes.copy_bytes,), dtype=torch.uint8, device=sizes.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = timed(lambda: dst.copy_(src), sizes.smoke)
    return 2 * sizes.copy_bytes / (ms / 1e3)


def each_shape(run: Run, shapes, name: str, row) -> list[list]:
    """`row(*shape)` for every shape in time; one that raises (out of memory, say) fails the run
    but not the shapes after it."""
    rows = []
    for shape in shapes:
        what = f"{name} {shape}"
        if run.out_of_time(what):
            continue
        run.log(what)
        try:
            rows.append(row(*shape))
        except Exception as error:
            run.log(traceback.format_exc())
            run.check(False, f"{what} raised {type(error).__name__}: {error}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def decode_section(run: Run, sizes: Sizes) -> str:
    from hf_paged_kv.kernels.paged_decode import choose_splits, paged_decode

    dtype, device = sizes.kernel_dtype, torch.device(sizes.device)
    tolerance = KERNEL_TOLERANCE[dtype]
    copy_bw = copy_bandwidth(sizes)
    run.log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    labels = set()

    def row(context: int, batch: int) -> list:
        key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, context, sizes, dtype)
        query = torch.randn(batch, sizes.heads, sizes.head_dim, dtype=dtype, device=device)
        q_pos = lens.long() - 1
        scale = sizes.head_dim**-0.5
        splits = choose_splits(batch, sizes.kv_heads, context, device)  # from the host's length: no sync

        def ours(out=None):
            return paged_decode(query, key_cache, value_cache, tables, lens, q_pos, scale, num_splits=splits, out=out)

        baseline = fast_sdpa(query[:, :, None], k, v, scale)
        labels.add(baseline.label)
        ref = reference_attention(query[:, :, None], k, v, scale)[:, :, 0]
        got = ours(out=torch.full_like(query, float("nan")))  # an element never written stays NaN
        with baseline.context():
            want = baseline.fn()[:, :, 0]
        errors = {"paged": relative_error(got, ref), "SDPA": relative_error(want, ref)}
        verdict = judge(run, f"decode batch {batch} context {context}", errors, tolerance)
        del ref, got, want
        ms = compare_times({"paged": (ours, contextlib.nullcontext), "sdpa": (baseline.fn, baseline.context)},
                           sizes.rounds, sizes.smoke)
        read = 2 * batch * context * sizes.kv_heads * sizes.head_dim * key_cache.element_size()
        bandwidth = read / (ms["paged"] / 1e3)
        return [batch, context, splits, f"{ms['paged']:.3f}", f"{bandwidth / 1e9:.0f}",
                f"{100 * bandwidth / copy_bw:.0f}%", f"{ms['sdpa']:.3f}", f"{ms['sdpa'] / ms['paged']:.2f}x",
                f"{errors['paged']:.1e}", f"{errors['SDPA']:.1e}", f"{tolerance:.0e}", verdict]

    shapes = [(context, batch) for context in sizes.contexts for batch in sizes.batches]
    rows = each_shape(run, shapes, "decode (context, batch)", row)
    header = ["batch", "context", "splits", "paged_decode ms", "GB/s", "% of copy BW", "SDPA contiguous ms",
              "SDPA ms / paged ms", "rel. err paged", "rel. err SDPA", "tolerance", "outputs"]
    return (f"Decode ({sizes.heads} query / {sizes.kv_heads} KV heads, dim {sizes.head_dim}, {dtype}, block "
            f"{sizes.block_size}, shuffled block tables; `num_splits` from `choose_splits` with the host's length). "
            f"Baseline: SDPA on the same KV stored contiguously ({'; '.join(sorted(labels))}). Copy bandwidth "
            f"{copy_bw / 1e9:.0f} GB/s (read + write). Timing: {method(sizes)}. Errors: ‖out − ref‖ / ‖ref‖ "
            f"against fp32 attention on the same inputs:\n\n" + markdown_table(header, rows))


def prefill_section(run: Run, sizes: Sizes) -> str:
    from hf_paged_kv.kernels.paged_prefill import paged_prefill

    dtype, device = sizes.kernel_dtype, sizes.device
    tolerance = KERNEL_TOLERANCE[dtype]

    def row(batch: int, new: int, prefix: int) -> list:
        key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, prefix + new, sizes, dtype)
        query = torch.randn(batch, sizes.heads, new, sizes.head_dim, dtype=dtype, device=device)
        q_pos = (prefix + torch.arange(new, device=device)).expand(batch, new).contiguous()
        scale = sizes.head_dim**-0.5

        def ours(out=None):
            return paged_prefill(query, key_cache, value_cache, tables, lens, q_pos, scale, out=out)

        if prefix == 0:  # top-left causal is the right mask: no mask tensor, the fast kernels take it
            mask, causal = None, True
        else:  # new tokens see the whole prefix: bottom-right aligned causal mask
            keys = torch.arange(prefix + new, device=device)
            mask, causal = keys[None, :] <= (prefix + torch.arange(new, device=device))[:, None], False
        baseline = fast_sdpa(query, k, v, scale, mask, causal)
        ref = reference_attention(query, k, v, scale, mask, causal, rows=1)
        got = ours(out=torch.full_like(query, float("nan")))
        with baseline.context():
            want = baseline.fn()
        errors = {"paged": relative_error(got, ref), "SDPA": relative_error(want, ref)}
        verdict = judge(run, f"prefill batch {batch} new {new} prefix {prefix}", errors, tolerance)
        del ref, got, want
        ms = compare_times({"paged": (ours, contextlib.nullcontext), "sdpa": (baseline.fn, baseline.context)},
                           sizes.rounds, sizes.smoke)
        return [batch, new, prefix, f"{ms['paged']:.3f}", f"{ms['sdpa']:.3f}", baseline.label,
                f"{ms['sdpa'] / ms['paged']:.2f}x", f"{errors['paged']:.1e}", f"{errors['SDPA']:.1e}",
                f"{tolerance:.0e}", verdict]

    rows = each_shape(run, sizes.prefill, "prefill (batch, new, prefix)", row)
    header = ["batch", "new tokens", "cached prefix", "paged_prefill ms", "SDPA contiguous ms", "SDPA form",
              "SDPA ms / paged ms", "rel. err paged", "rel. err SDPA", "tolerance", "outputs"]
    return (f"Prefill (same heads, {dtype}). Baseline: SDPA on contiguous KV, `is_causal` without a mask when "
            f"nothing is cached, else a bottom-right causal mask with K/V heads expanded before timing. Timing: "
            f"{method(sizes)}. Errors as for decode:\n\n" + markdown_table(header, rows))


# --------------------------------------------------------------------- models (steps 4-5)
class Models:
    """SmolLM2-135M in fp32 (correctness) and in the timing dtype, the same weights; built once."""

    def __init__(self, run: Run, sizes: Sizes):
        self.run, self.sizes, self.built = run, sizes, None

    def get(self):
        if self.built is None:
            self.built = self._build()
        return self.built

    def _build(self):
        sizes, model = self.sizes, None
        if not sizes.smoke:
            try:
                spec = importlib.util.spec_from_file_location("real_model", ROOT / "examples" / "real_model.py")
                loader = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(loader)
                model, _ = loader.load_smollm2(dtype=torch.float32)
                source = "(real weights)"
            except Exception as error:  # the GGUF package (or gguf) is not on this machine
                self.run.log(f"real SmolLM2 not available ({type(error).__name__}: {error}); random weights")
        if model is None:
            heads, kv_heads = (3, 1) if sizes.smoke else (9, 3)  # fewer programs for the interpreter
            config = LlamaConfig(
                vocab_size=49152, hidden_size=64 * heads, intermediate_size=1536, num_hidden_layers=sizes.layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=8192,
                rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2,
                initializer_range=RANDOM_INIT,
            )
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).eval()
            layers = f"{sizes.layers} layers, {heads}/{kv_heads} heads, " if sizes.smoke else ""
            source = f"(its config, {layers}random weights, initializer_range={RANDOM_INIT})"
        model.generation_config.pad_token_id = model.config.pad_token_id
        model = model.to(sizes.device)
        speed = model if sizes.speed_dtype == torch.float32 else copy.deepcopy(model).to(sizes.speed_dtype)
        return model, speed, source


def random_prompts(batch: int, length: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=gen).to(device)


def left_padded(lengths: list[int], vocab: int, pad: int, seed: int, device: str):
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = random_prompts(1, n, vocab, seed + row, "cpu")[0]
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, cache, new: int, logits: bool = False):
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=model.generation_config.pad_token_id,
                              output_logits=logits, return_dict_in_generate=logits)


@dataclass
class Agreement:
    equal: bool  # every new token of every row
    token_share: float  # share of new tokens equal
    logit_error: float  # max |logit difference| over steps whose inputs are identical
    logit_scale: float  # max |logit| over the same steps
    finite: bool
    first_difference: str  # row, step and the reference's margin there, or ""

    @property
    def relative(self) -> float:
        return self.logit_error / self.logit_scale if self.logit_scale else float("nan")


def agreement(reference, other, new: int) -> Agreement:
    """Compare two `generate` outputs (with logits) of the same prompts."""
    ref_new, other_new = reference.sequences[:, -new:], other.sequences[:, -new:]
    error = scale = 0.0
    finite = True
    for step in range(new):
        same = (ref_new[:, :step] == other_new[:, :step]).all(dim=1)  # inputs identical up to this step
        a, b = reference.logits[step].float(), other.logits[step].float()
        finite = finite and bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
        if same.any():
            error = max(error, (a[same] - b[same]).abs().max().item())
            scale = max(scale, a[same].abs().max().item())
    first = ""
    differ = (ref_new != other_new).nonzero()
    if len(differ):
        row, step = differ[0].tolist()
        logits = reference.logits[step][row].float()
        mine, theirs = int(ref_new[row, step]), int(other_new[row, step])
        first = (f"row {row} step {step}: token {theirs} instead of {mine}, whose logit leads it by "
                 f"{(logits[mine] - logits[theirs]).item():.2e} in the reference")
    share = (ref_new == other_new).float().mean().item()
    return Agreement(torch.equal(ref_new, other_new), share, error, scale, finite, first)


def end_to_end_section(run: Run, sizes: Sizes, models: Models) -> str:
    model32, speed_model, source = models.get()
    device, vocab = sizes.device, model32.config.vocab_size
    pad = model32.generation_config.pad_token_id

    # fp32: token equality with DynamicCache, left-padded batch of different lengths
    run.log("end to end: fp32 token equality")
    pool32 = KVPool(num_blocks=sizes.pool_blocks, block_size=sizes.block_size)
    hf_paged_kv.enable(model32, pool=pool32, backend="triton")
    try:
        run.check(state_of(model32).backend.name == "triton", "end to end (fp32): the Triton backend is in use")
        ids, mask = left_padded(sizes.fp32_lengths, vocab, pad, seed=100, device=device)
        dynamic = generate(model32, ids, mask, DynamicCache(), sizes.fp32_new, logits=True)
        with PagedCache(reuse=False) as cache:
            paged = generate(model32, ids, mask, cache, sizes.fp32_new, logits=True)
        fp32 = agreement(dynamic, paged, sizes.fp32_new)
        run.check(fp32.equal, f"end to end fp32: PagedCache tokens differ from DynamicCache's "
                              f"({fp32.first_difference}; max |logit difference| before it {fp32.logit_error:.1e})")
        run.check(fp32.finite and fp32.relative <= FP32_LOGIT_TOLERANCE,
                  f"end to end fp32: max |logit difference| {fp32.logit_error:.1e} is over {FP32_LOGIT_TOLERANCE:.0e} "
                  f"of the largest logit {fp32.logit_scale:.1f} (or not finite)")
        run.check(pool32.audit()["references"] == 0, "end to end fp32: blocks still referenced after release")
    finally:
        hf_paged_kv.disable(model32)
    del dynamic, paged

    # timing dtype: measured logit differences, against those between two transformers attentions
    run.log(f"end to end: {sizes.speed_dtype} logit differences")
    batch, prompt, new = sizes.bf16_report
    ids = random_prompts(batch, prompt, vocab, seed=200, device=device)
    mask = torch.ones_like(ids)
    reference = generate(speed_model, ids, mask, DynamicCache(), new, logits=True)
    previous = speed_model.config._attn_implementation
    speed_model.set_attn_implementation("eager")
    try:
        eager = generate(speed_model, ids, mask, DynamicCache(), new, logits=True)
    finally:
        speed_model.set_attn_implementation(previous)
    floor = agreement(reference, eager, new)
    del eager

    pool = KVPool(num_blocks=sizes.pool_blocks, block_size=sizes.block_size)
    hf_paged_kv.enable(speed_model, pool=pool, backend="triton")
    try:
        with PagedCache(reuse=False) as cache:
            paged = generate(speed_model, ids, mask, cache, new, logits=True)
        measured = agreement(reference, paged, new)
        run.check(measured.finite, f"end to end {sizes.speed_dtype}: PagedCache logits are not finite")
        del reference, paged
        rows = each_shape(run, sizes.e2e, "end to end timing (batch, prompt, new)",
                          lambda *shape: timing_row(run, sizes, speed_model, pool, shape))
        run.check(pool.audit()["references"] == 0, "end to end: blocks still referenced after release")
    finally:
        hf_paged_kv.disable(speed_model)

    dtype = str(sizes.speed_dtype).replace("torch.", "")
    header = ["batch", "prompt", "new tokens", "DynamicCache tok/s", "PagedCache (triton) tok/s", "speed-up",
              f"same tokens ({dtype})"]
    return (f"End to end, SmolLM2-135M {source}, greedy `generate`, {dtype}; generated tokens per second, prefill "
            f"included; `PagedCache(reuse=False)` (every prompt token computed, checked) against `DynamicCache`, "
            f"fresh random prompts each round (the same for both), one warm-up each, median of {sizes.rounds} "
            f"rounds of alternating order.\n\n"
            f"- fp32 correctness ({len(sizes.fp32_lengths)} left-padded prompts of {sizes.fp32_lengths} tokens, "
            f"{sizes.fp32_new} new): tokens identical to DynamicCache's: {'yes' if fp32.equal else 'NO'}; max |logit "
            f"difference| {fp32.logit_error:.1e} (largest logit {fp32.logit_scale:.1f}; tolerance "
            f"{FP32_LOGIT_TOLERANCE:.0e} of it).\n"
            f"- {dtype}, measured ({batch} prompts of {prompt} tokens, {new} new; logits compared while the inputs "
            f"are identical): PagedCache against DynamicCache (SDPA) max |logit difference| "
            f"{measured.logit_error:.2g} (largest logit {measured.logit_scale:.1f}), {100 * measured.token_share:.0f}% "
            f"of tokens equal; for scale, transformers' eager attention against its SDPA: "
            f"{floor.logit_error:.2g}, {100 * floor.token_share:.0f}% of tokens equal.\n\n"
            + markdown_table(header, rows))


def timing_row(run: Run, sizes: Sizes, model, pool: KVPool, shape) -> list:
    batch, prompt, new = shape
    device, vocab = sizes.device, model.config.vocab_size

    def once(kind: str, ids):
        mask = torch.ones_like(ids)
        cache = DynamicCache() if kind == "dynamic" else PagedCache(reuse=False)
        synchronize(device)
        start = time.perf_counter()
        out = generate(model, ids, mask, cache, new)
        synchronize(device)
        seconds = time.perf_counter() - start
        if kind == "paged":  # the same work as DynamicCache: no prompt token skipped, all stored
            work = (cache.inherited, cache.row_lengths())
            cache.release()
            run.check(work == ([0] * batch, [prompt + new - 1] * batch),
                      f"end to end batch {batch}: PagedCache inherited/stored {work}, expected nothing inherited "
                      f"and {prompt + new - 1} tokens stored per row")
        return seconds, out

    warm = random_prompts(batch, prompt, vocab, seed=300 + batch, device=device)
    once("dynamic", warm), once("paged", warm)  # compile kernels, fill allocator caches
    times = {"dynamic": [], "paged": []}
    equal = total = 0
    for r in range(sizes.rounds):
        ids = random_prompts(batch, prompt, vocab, seed=1000 * (r + 1) + batch, device=device)
        outs = {}
        for kind in (("dynamic", "paged") if r % 2 == 0 else ("paged", "dynamic")):
            seconds, outs[kind] = once(kind, ids)
            times[kind].append(seconds)
        equal += (outs["dynamic"][:, prompt:] == outs["paged"][:, prompt:]).sum().item()
        total += batch * new
    t_dyn, t_pag = statistics.median(times["dynamic"]), statistics.median(times["paged"])
    return [batch, prompt, new, f"{batch * new / t_dyn:.0f}", f"{batch * new / t_pag:.0f}", f"{t_dyn / t_pag:.2f}x",
            f"{100 * equal / total:.0f}%"]


# ------------------------------------------------------------------------ step 5: host tier
@dataclass
class FirstToken:
    seconds: float
    token: int
    inherited: int
    seen: object = None  # what `inspect` returned while the cache was open


def host_tier_section(run: Run, sizes: Sizes, models: Models) -> str:
    model, _, source = models.get()
    n = sizes.tier_prompt // sizes.block_size
    pool = KVPool(num_blocks=2 * n + 8, block_size=sizes.block_size, host_blocks=2 * n, hot_threshold=None)
    hf_paged_kv.enable(model, pool=pool)
    try:
        return HostTierCheck(run, sizes, model, pool, source).run_all()
    finally:
        hf_paged_kv.disable(model)


class HostTierCheck:
    """A prompt of `n` whole blocks (+ 8 tokens) that moves between the device and the host tier."""

    def __init__(self, run: Run, sizes: Sizes, model, pool: KVPool, source: str):
        self.run, self.sizes, self.model, self.pool, self.source = run, sizes, model, pool, source
        self.device = sizes.device
        self.n = sizes.tier_prompt // sizes.block_size
        self.prefix = self.n * sizes.block_size  # tokens a hit inherits
        vocab = model.config.vocab_size
        self.prompt = random_prompts(1, self.prefix + 8, vocab, seed=7, device=self.device)
        self.mask = torch.ones_like(self.prompt)
        self.tokens = self.prompt[0].tolist()

    # -- helpers
    def where(self) -> dict[str, int]:
        return hf_paged_kv.cached_tokens(self.model, self.tokens)

    def expect_where(self, tier: str, when: str) -> bool:
        found = self.where()
        ok = found[tier] == self.prefix and sum(found.values()) == self.prefix
        return self.run.check(ok, f"host tier, {when}: the prompt's {self.prefix} tokens should be on the {tier}, "
                                  f"cached_tokens says {found}")

    def first_token(self, reuse: bool, inspect=None) -> FirstToken:
        synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode(), PagedCache(reuse=reuse) as cache:
            out = self.model.generate(input_ids=self.prompt, attention_mask=self.mask, past_key_values=cache,
                                      max_new_tokens=1, do_sample=False,
                                      pad_token_id=self.model.generation_config.pad_token_id)
            synchronize(self.device)
            seconds = time.perf_counter() - start
            seen = inspect(cache) if inspect is not None else None
            inherited = cache.inherited[0]
        return FirstToken(seconds, int(out[0, -1]), inherited, seen)

    def snapshot(self, cache: PagedCache):
        """The prompt's whole blocks as the open cache holds them: ids and contents, every layer."""
        blocks = cache.block_tables()[0][: self.n]
        index = torch.tensor(blocks, device=self.device)
        return blocks, [c.index_select(0, index) for c in self.pool.key_cache + self.pool.value_cache]

    def push_to_host(self) -> None:
        """Pool pressure: allocating every available block evicts (demotes) every cached one."""
        taken = self.pool.allocate(self.pool.num_available())
        self.pool.decref(taken)

    def same_data(self, a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    # -- the checks
    def run_all(self) -> str:
        run, sizes = self.run, self.sizes
        run.log(f"host tier: {self.prefix + 8}-token prompt, {self.n} blocks x {len(self.pool.key_cache)} layers")
        self.first_token(False), self.first_token(True)  # warm-up; the second run stores the prompt's blocks
        self.expect_where("device", "after the first run with reuse")
        device_snapshot = self.first_token(True, self.snapshot)
        self.reference = device_snapshot.seen  # the prompt's blocks as first computed
        run.check(device_snapshot.inherited == self.prefix, f"host tier: a device hit inherited "
                                                            f"{device_snapshot.inherited} tokens, not {self.prefix}")
        self.push_to_host()
        self.expect_where("host", "after pool pressure")
        round_trip = self.first_token(True, self.snapshot)  # also the warm-up of the promotion path
        exact = run.check(round_trip.inherited == self.prefix and self.same_data(device_snapshot.seen, round_trip.seen),
                          "host tier: blocks promoted from the host differ from the device blocks they were")
        self.expect_where("device", "after a host-tier hit")
        timings = self.timings()
        waited, landed = self.straggler(drop_wait=False)
        control = self.control()
        pinned = stream = "n/a (CPU)"
        if self.device == "cuda":
            host = self.pool.tiers.host
            pinned = "yes" if run.check(host.keys[0].is_pinned(), "host tier memory is not page-locked") else "NO"
            stream = "yes" if run.check(host.stream is not None, "host tier has no side stream") else "NO"
        stats = self.pool.stats()
        run.check(self.pool.audit()["references"] == 0, "host tier: blocks still referenced after every request")
        summary = (f"promoted blocks bit-exact: {'yes' if exact else 'NO'}; a promotion into blocks a queued kernel "
                   f"still writes waits for it: {'yes' if waited else 'NO'} (promoted into {landed}); {control}; "
                   f"host memory page-locked: {pinned}; side stream: {stream}; {stats.get('promotions', '?')} "
                   f"promotions, {stats.get('copy_bytes', 0) / 2**20:.0f} MiB copied between the tiers")
        header = ["time to first token", f"ms (median of {sizes.rounds})", "recompute ms / this", "tokens inherited",
                  "same token as recompute"]
        return (f"Host tier on {self.device}, SmolLM2-135M {self.source} fp32, backend "
                f"{state_of(self.model).backend.name}, {self.prefix + 8}-token prompt ({self.n} blocks x "
                f"{len(self.pool.key_cache)} layers); where the prompt is checked with `cached_tokens` before every "
                f"run; the three runs of a round in rotated order: {summary}:\n\n" + markdown_table(header, timings))

    def timings(self) -> list[list]:
        run, sizes = self.run, self.sizes
        kinds = ["recompute (reuse off)", "device-pool hit", "host-tier hit"]
        results = {kind: [] for kind in kinds}
        for r in range(sizes.rounds):
            shift = r % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                if kind == "host-tier hit":
                    self.push_to_host()
                    self.expect_where("host", f"before a timed host-tier hit (round {r})")
                elif kind == "device-pool hit":
                    if self.where()["device"] != self.prefix:
                        self.first_token(True)  # untimed: bring it back
                    self.expect_where("device", f"before a timed device hit (round {r})")
                result = self.first_token(kind != kinds[0])
                expected = 0 if kind == kinds[0] else self.prefix
                run.check(result.inherited == expected,
                          f"host tier {kind} (round {r}): inherited {result.inherited} tokens, not {expected}")
                results[kind].append(result)
        recompute_token = results[kinds[0]][0].token
        t_recompute = statistics.median(x.seconds for x in results[kinds[0]])
        rows = []
        for kind in kinds:
            same = all(x.token == recompute_token for x in results[kind])
            run.check(same, f"host tier {kind}: first token differs from recomputing's "
                            f"({[x.token for x in results[kind]]} vs {recompute_token})")
            seconds = statistics.median(x.seconds for x in results[kind])
            rows.append([kind, f"{1e3 * seconds:.1f}", f"{t_recompute / seconds:.2f}x", results[kind][0].inherited,
                         "yes" if same else "NO"])
        return rows

    def straggler(self, drop_wait: bool):
        """Hold every block; let go of `n + 4` of them only once the next forward has done its
        host work (at its first pool lock, after the host reads that wait for the GPU), right
        after queueing, behind a long GPU sleep, writes of JUNK into exactly those blocks. The
        promotions then have only those blocks to land in, and must wait for the writes.
        Returns (promoted blocks bit-exact, where they landed)."""
        run, pool = self.run, self.pool
        held = pool.allocate(pool.num_available())  # also pushes the prompt to the host tier
        self.expect_where("host", "before the straggler run")
        straggled, rest = held[: self.n + 4], held[self.n + 4 :]
        index = torch.tensor(straggled, device=self.device)  # made now: a copy to the GPU later would sync
        done = []

        def straggle():
            if self.device == "cuda":
                torch.cuda._sleep(STRAGGLER_CYCLES)
            for cache in pool.key_cache + pool.value_cache:
                cache.index_fill_(0, index, JUNK)
            pool.decref(straggled)  # the pool notes the point after these writes
            if drop_wait:  # the control: forget that point, as a promotion without the wait would
                for block in straggled:
                    pool.tiers.host.idle_since.pop(block, None)
            done.append(True)

        if hasattr(pool, "defer"):
            pool.defer(straggle)  # runs at the next pool lock: inside the forward, before it promotes
        else:  # no way to queue work inside the forward: before it, where its host syncs make it moot
            run.log("KVPool.defer is gone: the straggler runs before generate, where it proves little")
            straggle()
        result = self.first_token(True, self.snapshot)
        pool.decref(rest)
        blocks, _ = result.seen
        inside = set(blocks) <= set(straggled)
        landed = "straggled blocks only" if inside else f"other blocks too: {blocks}"
        exact = self.same_data(self.reference, result.seen)
        if not drop_wait:
            run.check(bool(done), "host tier straggler: the queued work never ran")
            run.check(result.inherited == self.prefix,
                      f"host tier straggler: inherited {result.inherited} tokens, not {self.prefix}")
            run.check(inside, f"host tier straggler: promoted into blocks that were never let go: {blocks}")
            run.check(exact, "host tier straggler: a promotion into a block a queued kernel writes did not wait for it")
        return exact, landed

    def control(self) -> str:
        """The straggler run again with the pool's record of the writes dropped: the promoted
        blocks must then come out wrong, or the check above could not have failed. Last, since it
        leaves corrupted blocks in the index."""
        if self.device != "cuda":
            return "control without the wait: n/a (CPU copies are synchronous)"
        if not hasattr(self.pool, "defer") or not hasattr(self.pool.tiers.host, "idle_since"):
            return "control without the wait: not run (the pool no longer exposes what it needs)"
        exact, _ = self.straggler(drop_wait=True)
        if exact:
            return ("control without the wait: INCONCLUSIVE (the blocks came out right even without the wait, so the "
                    "check above could not fail here)")
        return "control without the wait: the blocks come out wrong (so the check above can fail)"


if __name__ == "__main__":
    sys.exit(main())
