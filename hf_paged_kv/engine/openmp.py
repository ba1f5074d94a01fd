"""Keeping GNU OpenMP from throttling the engine's thread on CPU.

torch's CPU builds run their intra-op parallel regions on GNU OpenMP (libgomp). Each thread
that starts a parallel region gets a pool of worker threads of its own, and the pool outlives
the region. Once the process holds more libgomp threads than the machine has cores – the
user's thread that loaded the model keeps its workers, and the engine's thread needs its own –
libgomp lets each worker spin only ~100 times before it sleeps, instead of ~300,000, so every
parallel region pays a futex wake-up. Measured on a 2-core machine: a 200k-element add took
0.12 ms on a second thread against 0.02 ms on the main thread, and a SmolLM2-135M decode step
81 ms against 53 ms (1.5x), until the main thread's workers were released.

`release_workers()` hands the calling thread's workers back (`omp_pause_resource_all`, OpenMP
5.0); libgomp creates them again at that thread's next parallel region. The engine calls it on
the thread that starts it and on its own thread whenever it goes idle, so that neither throttles
the other. torch work on another thread *while* the engine is busy still pays the cost on both
sides: serve from one thread.
"""

from __future__ import annotations

import ctypes
import logging
import os

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not just park them
log = logging.getLogger("hf_paged_kv.engine")
_runtimes: dict[str, object] = {}  # path of a loaded libgomp -> its omp_pause_resource_all, or None


def release_workers() -> int:
    """Free the calling thread's OpenMP worker threads in every libgomp loaded in this process
    (torch's, and any other library's copy). Call it only outside parallel regions, from a
    thread that is about to stop using torch for a while. Returns how many runtimes released
    their workers; 0 where there is no libgomp (other platforms, other OpenMP runtimes). Never
    raises: it only saves time, and a libgomp it cannot load is skipped (and logged once)."""
    released = 0
    for path in loaded_libgomp():
        if path not in _runtimes:
            try:
                _runtimes[path] = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)  # None before OpenMP 5.0
            except OSError as error:
                log.warning("cannot load %s to release its OpenMP workers: %s", path, error)
                _runtimes[path] = None
        pause = _runtimes[path]
        if pause is not None and pause(_OMP_PAUSE_HARD) == 0:
            released += 1
    return released


def loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (Linux; none elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            # the path is the sixth field, and may hold spaces ("/home/u/My Projects/.venv/...")
            paths = {fields[5].rstrip("\n") for fields in (line.split(maxsplit=5) for line in maps)
                     if len(fields) == 6 and "/libgomp" in fields[5]}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libgomp"))
