"""Score modifications as the kernels take them (kernels.py, MOD_KIND), built from a case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LOG2E = 1.4426950408889634  # the kernels' scores are in log2 units


@dataclass(frozen=True)
class ModArgs:
    """A score modification as the kernels take it (kernels.py, MOD_KIND): softcap's cap in log2 units, or a bias
    (H, 2N - 1) float32 by head and distance pos - key + N - 1, in log2 units."""

    kind: int = 0
    cap2: float = 1.0
    bias: Tensor | None = None

    def kwargs(self, device: torch.device) -> dict[str, Any]:
        bias = self.bias if self.bias is not None else torch.zeros(1, dtype=torch.float32, device=device)
        return {"BIAS": bias, "cap2": self.cap2, "MOD_KIND": self.kind}


def mod_args(case, device: torch.device) -> ModArgs | None:
    """The case's built-in score modification for the kernels (None without one)."""
    mod = case.make_score_mod()
    if mod is None:
        return None
    if mod.kind == "softcap":
        return ModArgs(1, float(mod.cap) * LOG2E)
    n = case.seq_len  # ALiBi and T5's bias depend on the head and i - j only: i - j = e - (N - 1) at entry e
    bias = mod.apply(torch.zeros((), dtype=torch.float64), torch.arange(case.heads)[:, None],
                     torch.arange(2 * n - 1)[None, :], torch.full((1, 1), n - 1))
    return ModArgs(2, bias=(bias.to(torch.float32) * LOG2E).contiguous().to(device))
