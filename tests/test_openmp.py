"""The engine and GNU OpenMP: a thread's idle OpenMP workers outlive its parallel regions, and
more libgomp threads than cores make every region slow (see hf_paged_kv/engine/openmp.py).
`release_workers` frees the calling thread's workers; the engine frees the starting thread's
at start and its own whenever it goes idle. Counted with the process's OS threads."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine import openmp

pytestmark = pytest.mark.skipif(
    torch.get_num_threads() < 2 or not openmp.loaded_libgomp() or not os.path.isdir("/proc/self/task"),
    reason="needs torch on GNU OpenMP with 2+ threads, on Linux")

WORKERS = torch.get_num_threads() - 1  # a thread's pool: the thread itself and this many workers


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_region() -> None:
    """One op large enough for torch to run it on all its threads."""
    big = torch.ones(1 << 22)
    torch.add(big, big)


def settled(expected: int, timeout: float = 2.0) -> int:
    """The OS thread count once it reaches `expected` or `timeout` passes: a released worker
    leaves /proc a moment after the call returns (CI once counted it still there)."""
    deadline = time.monotonic() + timeout
    while os_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()


def on_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_release_workers_frees_the_calling_threads_workers():
    def run():
        parallel_region()
        with_workers = os_threads()
        released = openmp.release_workers()
        return with_workers, settled(with_workers - WORKERS), released

    with_workers, after, released = on_new_thread(run)
    assert released >= 1
    assert after == with_workers - WORKERS


def test_release_workers_is_harmless_and_torch_recreates_them():
    def run():
        openmp.release_workers()  # nothing to release yet
        before = os_threads()
        parallel_region()
        with_workers = os_threads()
        openmp.release_workers()
        parallel_region()  # works again, on fresh workers
        return before, with_workers, os_threads()

    before, with_workers, again = on_new_thread(run)
    assert with_workers == before + WORKERS and again == with_workers


def test_engine_frees_workers_at_start_and_when_idle():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()  # large enough that its forwards run parallel regions
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=16), controller=False)
    parallel_region()
    openmp.release_workers()
    parallel_region()  # this thread now holds workers, as after loading a model
    holding = os_threads()
    try:
        engine.start()
        started = settled(holding - WORKERS + 1)
        assert started == holding - WORKERS + 1  # this thread's workers freed; the engine's thread
        prompt = torch.randint(3, 4096, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        assert len(engine.submit(prompt, max_new_tokens=4, eos_token_id=[]).result(timeout=60)) == 4
        assert settled(started, timeout=5.0) == started  # idle again: its own workers freed
    finally:
        engine.stop()
        hf_paged_kv.disable(model)


def test_a_libgomp_path_with_spaces_is_read_whole_and_one_that_cannot_load_is_skipped(monkeypatch, caplog):
    """/proc/self/maps ends each line with the path, which may hold spaces; a copy that cannot be
    loaded costs only its release (logged), never the engine's start or its loop."""
    import io

    maps = ("7f00-7f10 r-xp 00000000 08:01 123 /home/u/My Projects/.venv/lib/libgomp-a34b3233.so.1\n"
            "7f10-7f20 r--p 00000000 08:01 124 /usr/lib/libc.so.6\n")
    monkeypatch.setattr(openmp, "open", lambda path: io.StringIO(maps), raising=False)
    assert openmp.loaded_libgomp() == ["/home/u/My Projects/.venv/lib/libgomp-a34b3233.so.1"]
    with caplog.at_level("WARNING", logger="hf_paged_kv.engine"):
        assert openmp.release_workers() == 0
    assert "cannot load /home/u/My Projects" in caplog.text
