"""Small maths shared by several implementations (implementations never import each other)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision inputs accumulate the softmax in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim where `mask` allows; a row with no allowed entry gives zeros."""
    scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.where(mask.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))


def masked_lse_softmax(scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(probs, lse) over the last dim where `mask` allows, through the log-sum-exp the caller also returns: a row
    with no allowed entry gives zeros and lse -inf."""
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    return probs, lse


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor:
    """`out` (B, H, Nq, D) with the case's sink logits (H,) joined to each row's softmax (value vector zero):
    out * sigmoid(lse - sink), lse the row's log-sum-exp over its keys (-inf on an empty row, which stays 0).
    Written apart from the oracle's on purpose: an implementation never shares the oracle's code."""
    if sinks is None:
        return out
    gate = torch.sigmoid(lse.float() - sinks.to(device=lse.device, dtype=torch.float32)[None, :, None])
    return (out.float() * gate.unsqueeze(-1)).to(out.dtype)


def masked_softmax_(scores: Tensor, mask: Tensor) -> Tensor:
    """In-place `masked_softmax` for inference: no second score-sized buffer."""
    scores.masked_fill_(~mask, -math.inf)
    peak = scores.amax(dim=-1, keepdim=True)
    peak.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    scores.sub_(peak).exp_()
    denom = scores.sum(dim=-1, keepdim=True)
    return scores.div_(denom.clamp_min_(torch.finfo(scores.dtype).tiny))


def fold_heads(x: Tensor) -> Tensor:
    """(B, H, N, D) -> (B*H, N, D), a view when x is contiguous."""
    b, h, n, d = x.shape
    return x.reshape(b * h, n, d)


def unfold_heads(x: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """(B*H, N, D) -> (B, H, N, D) of `shape`."""
    return x.reshape(shape)


_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def run_steps(steps: list[Callable[[], T]], device: torch.device) -> list[T]:
    """Results of independent steps, in order; on CPU run side by side on Python threads.

    As many threads as torch has intra-op threads, each step's ops single-threaded (torch releases the GIL
    inside ops). Left to torch, every op would be an OpenMP parallel region ending in a barrier, a dozen
    per step, and on a loaded machine each barrier waits for a descheduled thread: `blocked` at N=4096,
    local W=256, H=8 on this 2-core machine under load took 490 ms per call that way, 88 ms with its
    steps on threads. Grad and inference modes, which are thread-local, follow the caller's.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or len(steps) < 2:
        return [step() for step in steps]
    global _pool, _pool_threads
    if _pool is None or _pool_threads != threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="impl-step")
        _pool_threads = threads
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(step: Callable[[], T]) -> T:
        # OpenMP's thread count is per thread; torch initialises a thread's lazily from a process-wide
        # default (which the caller's count restores below), so it is checked on every step.
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return step()

    try:
        return list(_pool.map(run, steps))
    finally:
        torch.set_num_threads(threads)  # the pool threads' setting is also the default of threads made later


class InOrder:
    """Lets step i into its block only after steps 0..i-1 have been through theirs.

    Steps on threads that add into one shared gradient would otherwise add in the order the threads happen
    to finish, and float sums in another order differ in the last bits: two identical runs would report
    different gradient errors. Each step must call `turn(i)` exactly once, also when it has nothing to add or
    failed before (`skip=True` passes the turn on), or the steps after it wait forever.
    """

    def __init__(self) -> None:
        self._next = 0
        self._ready = threading.Condition()

    @contextmanager
    def turn(self, i: int) -> Iterator[None]:
        with self._ready:
            self._ready.wait_for(lambda: self._next == i)
            try:
                yield
            finally:
                self._next += 1
                self._ready.notify_all()


ScoreFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def score_mod_fn(case, device: torch.device, dtype: torch.dtype) -> ScoreFn | None:
    """The case's score modification as fn(scores (..., H, c, n), i (c, 1), j (1, n)) -> scores, i and j
    absolute query and key positions (int64 on `device`), its tables in `dtype`; None without one."""
    mod = case.make_score_mod()
    if mod is None:
        return None
    mod = mod.for_device(device, dtype)
    heads = torch.arange(case.heads, device=device)[:, None, None]
    return lambda scores, i, j: mod.apply(scores, heads, i, j)


def positions(case, device: torch.device) -> tuple[Tensor, Tensor]:
    """(i (q_len, 1), j (1, N)): the absolute positions of the case's query rows and keys."""
    nq = case.n_queries
    i = torch.arange(case.seq_len - nq, case.seq_len, device=device)[:, None]
    return i, torch.arange(case.seq_len, device=device)[None, :]
