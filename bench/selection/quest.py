"""Quest's page bound (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference"; mit-han-lab/Quest: the per-page max/min metadata read by quest/ops/csrc/estimate.cu, the estimate of
quest/tests/test_estimate.py `_ref_cpu_estimate` and evaluation/quest_attention.py, the last page kept apart from
the top-k in quest/utils/__init__.py `decode_topk`).

Per query row and head, over pages of page_size keys (the case's `page_size` if it has one, else 16, Quest's
and FlashInfer's page): the channel-wise min and max of the page's keys, score = sum_d max(q_d * min_d, q_d *
max_d) (an upper bound of q . k over the page), the page holding the row's own position forced in (Quest keeps
the current, last page outside its top-k), the `budget` pages of largest score including it. Exactly
docs/DESIGN.md's definition. Quest is a decode method (one query row); here every row selects as the last one
would, over the pages its base pattern allows.

The bound is one GEMM of [relu(q), min(q, 0)] against [max, min] (2D wide). Cost: the extremes O(B Hkv N D);
the scores O(B H Nq (N / page) 2D) over each chunk's allowed span; a top-k over N / page scores per row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.selection.base import unit_size
from bench.selection.registry import register_selector
from bench.selection.units import grouped_scores, per_row_topk


def page_extremes(k: Tensor, page: int) -> tuple[Tensor, Tensor]:
    """float32 (B, Hkv, pages, D) each: the channel-wise min and max of each page's keys (a last, partial page
    over its own keys, as Quest's metadata of a partly filled page)."""
    b, hkv, n, d = k.shape
    pages = math.ceil(n / page)
    pad = (0, 0, 0, pages * page - n)
    kf = k.float()
    low = torch.nn.functional.pad(kf, pad, value=math.inf).view(b, hkv, pages, page, d).amin(dim=3)
    high = torch.nn.functional.pad(kf, pad, value=-math.inf).view(b, hkv, pages, page, d).amax(dim=3)
    return low, high


@register_selector("quest", q_unit="row", kv_unit="page", shared="head", takes="budget")
def quest(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """Quest: per row and head, the `budget` pages of largest sum_d max(q_d min_d, q_d max_d), its own forced."""
    page = unit_size("page", case.block_size, getattr(case, "page_size", None))
    low, high = page_extremes(k, page)
    bounds = torch.cat([high, low], dim=-1)  # (B, Hkv, P, 2D): q_d >= 0 meets max_d, q_d < 0 meets min_d

    def score(start: int, stop: int, lo: int, hi: int, allowed: Tensor) -> Tensor:
        rows = q[:, :, start:stop].float()
        split = torch.cat([rows.clamp(min=0), rows.clamp(max=0)], dim=-1)  # (B, H, rows, 2D)
        return grouped_scores(split, bounds[:, :, lo:hi])  # (B, H, rows, pages)

    def own(positions: Tensor, pages: Tensor) -> Tensor:
        return pages[None, :] == (positions // page)[:, None]

    return per_row_topk(q, case, page, q.shape[1], score, own)
