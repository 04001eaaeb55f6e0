"""Seeded q, k, v whose attention has the structure of a language model's (the `structured` inputs).

Independent Gaussians give nearly flat attention: no sinks, no locality, no heavy hitters, no needles, and every
selector of data-dependent sparse attention looks alike on them. This generator builds q and k before the rotary
embedding from a few components, then applies real RoPE (Su et al., the rotate-half layout of Hugging Face's
Llama) at each token's absolute position, so that what depends on distance comes from RoPE itself:

- noise: Gaussian q and k whose scaled product q.k/sqrt(D) has standard deviation `noise`;
- local: a vector shared by the queries and keys of a head, on RoPE's faster pairs. After rotation its product
  is sum_i |mu_i|^2 cos((m - n) theta_i): `local_logit` at distance 0, decaying with distance as the pairs fall
  out of phase (RoFormer's long-term decay); `locality` moves its energy to the fast pairs, for a sharper decay;
- content: directions on RoPE's slowest pairs (those that turn by at most a radian over the sequence), so that
  their products barely depend on distance. Sink tokens (the first `sinks`), heavy-hitter keys (a share
  `heavy_hitters` of the positions) and needle spans carry them in k; queries carry the sink and heavy-hitter
  directions of their head, and a needle's chosen query rows carry its direction;
- temperature: every logit divided by it.

Heads vary: each KV head is local, global or mixed (shares `local_heads`, `global_heads`), which scales its
local and heavy-hitter components (`KIND_SCALES`). The query heads of a GQA group read their KV head's keys, so
they share its kind and directions, each with its own strength (a factor in [0.75, 1.25]). Needles are planted
in every head; their positions are returned so that a selector's hit rate can be counted.

Everything is drawn on the CPU from one generator seeded by the case's seed: the same seed gives the same
tensors on every machine. A 32K x 32 heads x 128 case takes a few seconds on two cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.inputs.spec import StructuredKnobs

# Per head kind: (local component, heavy-hitter component) strength. Sinks and needles are the same for all.
KIND_SCALES = {"local": (1.0, 0.5), "mixed": (0.6, 1.0), "global": (0.2, 1.5)}
GROUP_JITTER = (0.75, 1.25)  # the range of a query head's own strength inside its GQA group


@dataclass(frozen=True)
class Needle:
    """A planted needle: key positions [start, end) that query rows `rows` (rows of the q_len x seq_len matrix)
    attend to strongly, in every head and batch element."""

    start: int
    end: int
    rows: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        return {"start": self.start, "end": self.end, "rows": list(self.rows)}


@dataclass
class StructuredInputs:
    q: Tensor  # (B, H, q_len, D) float32, after RoPE
    k: Tensor  # (B, Hkv, N, D) float32, after RoPE
    v: Tensor  # (B, Hkv, N, D) float32
    needles: list[Needle]
    head_kinds: list[str]  # per KV head: local | mixed | global
    heavy_positions: list[int]


def rope_frequencies(head_dim: int, theta: float) -> Tensor:
    """RoPE's angular frequencies theta^(-2i/D) for the D/2 rotated pairs (dims i and i + D/2), float64."""
    pairs = head_dim // 2
    return theta ** (-torch.arange(pairs, dtype=torch.float64) / max(pairs, 1))


def apply_rope_(x: Tensor, positions: Tensor, inv_freq: Tensor, chunk_rows: int = 4096) -> Tensor:
    """Rotate x (..., N, D) in place at `positions` (N,), pairs (i, i + D/2) as Hugging Face's rotate_half."""
    pairs = inv_freq.numel()
    for start in range(0, x.shape[-2], chunk_rows):
        rows = slice(start, start + chunk_rows)
        angles = positions[rows].to(torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x[..., rows, :pairs], x[..., rows, pairs : 2 * pairs]
        rotated_first = first * cos - second * sin
        second.mul_(cos).add_(first * sin)
        first.copy_(rotated_first)
    return x


def _content_pairs(inv_freq: Tensor, seq_len: int) -> Tensor:
    """Indices of the pairs that turn by at most a radian over the sequence (at least an eighth of them, and one)."""
    slow = torch.nonzero(inv_freq * seq_len <= 1.0).flatten()
    least = max(1, inv_freq.numel() // 8)
    if slow.numel() < least:
        slow = torch.arange(inv_freq.numel() - least, inv_freq.numel())
    return slow


def _directions(count: int, dims: Tensor, head_dim: int, gen: torch.Generator, against: Tensor | None = None
                ) -> Tensor:
    """`count` unit vectors (count, D) supported on `dims`, orthogonal to each other and to the rows of
    `against` where the subspace has room (else only normalised)."""
    raw = torch.randn(count, dims.numel(), generator=gen, dtype=torch.float64)
    basis = None if against is None else against[:, dims]
    if basis is not None and basis.shape[0] + count <= dims.numel():
        raw = raw - (raw @ basis.T) @ basis  # basis rows are orthonormal
    if count and (0 if basis is None else basis.shape[0]) + count <= dims.numel():
        raw = torch.linalg.qr(raw.T).Q.T[:count]
    raw = raw / raw.norm(dim=1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros(count, head_dim, dtype=torch.float64)
    out[:, dims] = raw
    return out


def head_kinds(kv_heads: int, knobs: StructuredKnobs, gen: torch.Generator) -> list[str]:
    """Each KV head's kind, in the shares the knobs ask for (rounded), in a seeded order."""
    local = min(kv_heads, round(knobs.local_heads * kv_heads))
    global_ = min(kv_heads - local, round(knobs.global_heads * kv_heads))
    kinds = ["local"] * local + ["global"] * global_ + ["mixed"] * (kv_heads - local - global_)
    order = torch.randperm(kv_heads, generator=gen).tolist()
    return [kinds[i] for i in order]


def plant_needles(seq_len: int, q_len: int, count: int, length: int, queries: int, sinks: int,
                  gen: torch.Generator) -> list[Needle]:
    """Up to `count` disjoint spans of `length` keys after the sinks, each with up to `queries` query rows that
    come after it (so that causal attention can reach it)."""
    q_offset = seq_len - q_len
    last = seq_len - 1  # the last query's position: a needle ends at or before it
    slots = max(0, (last - sinks) // length)
    if count == 0 or slots == 0:
        return []
    picked = torch.randperm(slots, generator=gen)[: min(count, slots)].sort().values.tolist()
    needles = []
    for slot in picked:
        start = sinks + slot * length
        end = start + length
        first_row = max(0, end - q_offset)  # rows at positions >= end
        eligible = q_len - first_row
        if eligible <= 0:
            continue
        chosen = torch.randperm(eligible, generator=gen)[: min(queries, eligible)] + first_row
        needles.append(Needle(start, end, tuple(sorted(chosen.tolist()))))
    return needles


def _head_vectors(heads: int, kv_heads: int, d: int, inv_freq: Tensor, fast: Tensor, content_dims: Tensor,
                  needle_dirs: Tensor | None, kinds: list[str], knobs: StructuredKnobs, gen: torch.Generator
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per KV head its local vector (fast pairs), sink and heavy-hitter directions (slow pairs), each (Hkv, D);
    and what every query row of head h adds (H, D), scaled by its KV head's kind. Drawn from `gen` in a fixed
    order (the inputs of a seed never change)."""
    amplitude = lambda logit: math.sqrt(logit * math.sqrt(d))  # noqa: E731 - q and k each carry this much
    pairs = inv_freq.numel()
    group = heads // kv_heads
    local_vec = torch.zeros(kv_heads, d, dtype=torch.float64)
    sink_dir = torch.zeros(kv_heads, d, dtype=torch.float64)
    heavy_dir = torch.zeros(kv_heads, d, dtype=torch.float64)
    energy = inv_freq[fast] ** knobs.locality if fast.numel() else None  # per fast pair, split at random inside
    for g in range(kv_heads):
        if energy is not None:
            angle = torch.rand(fast.numel(), generator=gen, dtype=torch.float64) * 2 * math.pi
            share = energy / energy.sum() * knobs.local_logit * math.sqrt(d)  # |mu|^2 = local_logit * sqrt(D)
            local_vec[g, fast] = share.sqrt() * angle.cos()
            local_vec[g, fast + pairs] = share.sqrt() * angle.sin()
        dirs = _directions(2, content_dims, d, gen, against=needle_dirs)
        sink_dir[g], heavy_dir[g] = dirs[0], dirs[1]
    jitter = GROUP_JITTER[0] + (GROUP_JITTER[1] - GROUP_JITTER[0]) * torch.rand(heads, generator=gen,
                                                                                dtype=torch.float64)
    q_add = torch.zeros(heads, d, dtype=torch.float64)
    for h in range(heads):
        g = h // group
        local_scale, heavy_scale = KIND_SCALES[kinds[g]]
        q_add[h] = jitter[h] * (local_scale * local_vec[g]
                                + amplitude(knobs.sink_logit) * sink_dir[g]
                                + heavy_scale * amplitude(knobs.heavy_logit) * heavy_dir[g])
    return local_vec, sink_dir, heavy_dir, q_add


def structured_inputs(*, batch: int, heads: int, kv_heads: int, seq_len: int, q_len: int, head_dim: int,
                      block_size: int, seed: int, knobs: StructuredKnobs) -> StructuredInputs:
    """The structured q (B, H, q_len, D), k, v (B, Hkv, N, D), float32 on the CPU (module docstring)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 2_718_281)
    d = head_dim
    amplitude = lambda logit: math.sqrt(logit * math.sqrt(d))  # noqa: E731 - q and k each carry this much
    inv_freq = rope_frequencies(d, knobs.rope_theta)
    content = _content_pairs(inv_freq, seq_len)
    pairs = inv_freq.numel()
    content_dims = torch.cat([content, content + pairs])
    fast = torch.tensor([i for i in range(pairs) if i not in set(content.tolist())], dtype=torch.int64)

    kinds = head_kinds(kv_heads, knobs, gen)
    length = knobs.needle_len or block_size
    needles = plant_needles(seq_len, q_len, knobs.needles, length, knobs.needle_queries, knobs.sinks, gen)
    needle_dirs = _directions(len(needles), content_dims, d, gen)
    heavy_count = max(1, round(knobs.heavy_hitters * seq_len)) if knobs.heavy_hitters > 0 else 0
    candidates = max(0, seq_len - knobs.sinks)
    heavy = (torch.randperm(candidates, generator=gen)[: min(heavy_count, candidates)] + knobs.sinks).sort().values

    local_vec, sink_dir, heavy_dir, q_add = _head_vectors(heads, kv_heads, d, inv_freq, fast, content_dims,
                                                          needle_dirs if len(needles) else None, kinds, knobs, gen)

    sigma = math.sqrt(knobs.noise)  # q.k/sqrt(D) of two N(0, sigma^2) vectors has std sigma^2
    q = torch.randn(batch, heads, q_len, d, generator=gen).mul_(sigma)
    k = torch.randn(batch, kv_heads, seq_len, d, generator=gen).mul_(sigma)
    v = torch.randn(batch, kv_heads, seq_len, d, generator=gen)
    q += q_add.float()[None, :, None, :]
    k += local_vec.float()[None, :, None, :]
    if knobs.sinks:
        k[:, :, : knobs.sinks] += (amplitude(knobs.sink_logit) * sink_dir).float()[None, :, None, :]
    if heavy.numel():
        k[:, :, heavy] += (amplitude(knobs.heavy_logit) * heavy_dir).float()[None, :, None, :]
    needle_amp = amplitude(knobs.needle_logit)
    for needle, direction in zip(needles, needle_dirs, strict=True):
        vec = (needle_amp * direction).float()
        k[:, :, needle.start : needle.end] += vec
        q[:, :, list(needle.rows)] += vec

    apply_rope_(q, torch.arange(seq_len - q_len, seq_len), inv_freq)
    apply_rope_(k, torch.arange(seq_len), inv_freq)
    if knobs.temperature != 1.0:
        q.div_(knobs.temperature)
    return StructuredInputs(q, k, v, needles, kinds, heavy.tolist())
