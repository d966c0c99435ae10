"""Intra-op threads of a tensor-parallel rank: its share of the host's cores, as vLLM gives each.

vLLM's multiprocessing executor on a CPU runs each rank with ``OMP_NUM_THREADS`` set to its own
list of cores (``vllm.utils.ompmultiprocessing``); its CUDA executor drops a worker's torch
threads to 1.  A pooled worker hosts one rank after another at torch's default (every core), so
``tp`` ranks on one host would run ``tp`` x cores threads — and vLLM's CPU shared-memory
all-reduce gives each of its thread contexts (one per torch thread, fixed when the group forms) a
partner thread on every other rank to spin-wait for: with more threads than cores a rank waits
for a partner that is not scheduled.  Measured on this 2-core host (tiny Llama, TP=2, one-token
requests back to back): 26 ms a request at 2 threads a rank, 12 ms at 1 (TP=1: 11-12 ms).

So each rank of a TP group runs ``max(1, cores // tp)`` threads, and a TP=1 engine the
process's default, set before the engine's threads start.  A new thread's OpenMP pool starts at
the process's initial size and takes torch's value only at its first torch parallel call; vLLM's
CPU attention sizes its metadata from the thread's OpenMP count and checks it again in the
kernel, so a thread that builds metadata before any torch op would disagree with itself (a fatal
check in vLLM).  Each engine thread calls :func:`adopt` first.  ``OMP_NUM_THREADS`` set by the
operator wins.
"""

from __future__ import annotations

import os

_DEFAULT: list[int] = []  # torch's thread count before this module changed it


def rank_threads(tp: int, cores: int, default: int) -> int:
    """Threads for one rank of a ``tp``-way group on ``cores`` cores (``default`` at TP 1)."""
    if tp <= 1:
        return max(1, default)
    return max(1, cores // tp)


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def use_rank_threads(tp: int) -> int:
    """Size torch's intra-op pool for a rank of a ``tp``-way engine built next in this process;
    returns the count.  Call before the engine's threads and its process group exist."""
    import torch

    if not _DEFAULT:
        _DEFAULT.append(torch.get_num_threads())
    if os.environ.get("OMP_NUM_THREADS"):
        return int(torch.get_num_threads())
    n = rank_threads(tp, host_cores(), _DEFAULT[0])
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once a rank is bound
    torch._C.set_num_threads(n)
    return n


def adopt() -> None:
    """Give the calling thread torch's thread count now (see module docstring)."""
    import torch

    torch.get_num_threads()  # torch's per-thread lazy init sets the thread's OpenMP count
