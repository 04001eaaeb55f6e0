"""Score modifications as the kernels take them (kernels.py, MOD_KIND), built from a case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LOG2E = 1.4426950408889634  # the kernels' scores are in log2 units
# MOD_KIND values (kernel_masks.py makes them constexpr for the jit code)
MOD_NONE, MOD_SOFTCAP, MOD_BIAS = 0, 1, 2


@dataclass(frozen=True)
class ModArgs:
    """A score modification as the kernels take it (kernels.py, MOD_KIND): softcap's cap in log2 units, or a bias
    (H, 2N - 1) float32 by head and distance pos - key + N - 1, in log2 units."""

    kind: int = MOD_NONE
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
        return ModArgs(MOD_SOFTCAP, float(mod.cap) * LOG2E)
    bias = mod.distance_bias(case.heads, case.seq_len)
    return ModArgs(MOD_BIAS, bias=(bias.to(torch.float32) * LOG2E).contiguous().to(device))
