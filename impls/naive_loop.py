"""`naive_loop`: seed 001's per-query loop, with its masking bug fixed.

The seed fills a zero (B, H, N, N) matrix with the scores inside each query's window and takes a softmax
over the whole row, so positions outside the window get score 0 and real weight. Here the matrix starts at
-inf, so they get none. The loop is kept on purpose: it is the baseline the seed measured against. Rows
whose allowed keys form a contiguous range are sliced exactly as in the seed; other patterns index the
row's keys from the pattern's CSR view. Query rows are the pattern's q_len rows (the last positions); the
query heads of one KV head read its keys through a broadcast, (B, Hkv, G, D) x (B, Hkv, K, D).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.common import accum_dtype, positions, score_mod_fn, softmax_scale


@register
class NaiveLoop(Impl):
    name = "naive_loop"
    description = "seed 001's per-query Python loop over an (N, N) score matrix, -inf outside the pattern"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # on each row's scores
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}

    def memory_bytes(self, case):
        # the float32 (B, H, N, N) matrix and its scaled copy under softmax (and a selection's bool mask)
        return 2 * case.score_bytes() + (case.score_bytes(1) if case.selector is not None else 0)

    def prepare(self, case, pattern, q, k, v):
        keys: list[slice | torch.Tensor] = []
        with setup_phase("mask"):
            crow, col = pattern.csr()
            for i in range(pattern.q_len):
                row = col[crow[i] : crow[i + 1]]
                if len(row) and int(row[-1]) - int(row[0]) + 1 == len(row):
                    keys.append(slice(int(row[0]), int(row[-1]) + 1))  # the seed's start:end window
                else:
                    keys.append(row.to(q.device))
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]

        needs_grad = any(t.requires_grad for t in (q, k, v))
        modify = score_mod_fn(case, q.device, acc)
        rows_at, keys_at = positions(case, q.device)

        def row_scores(i: int, k_acc: torch.Tensor) -> torch.Tensor:  # (B, H, |keys of row i|)
            row = q[:, :, i, :].reshape(b, hkv, h // hkv, d)  # (B, Hkv, G, D): the heads of each KV head
            # scores in the accumulation dtype (bfloat16 scores would round large logits by a tenth)
            scores = (row.to(acc) @ k_acc[:, :, keys[i], :].transpose(-2, -1)).reshape(b, h, -1)
            if modify is None:
                return scores
            # the modification is of the scaled score: scale, modify, unscale (the softmax below scales)
            modified = modify((scores * scale)[:, :, None], rows_at[i : i + 1], keys_at[:, keys[i]])
            return modified[:, :, 0] / scale

        def call():
            # K in the accumulation dtype once per call: its gradient then sums over the rows in float32 and is
            # rounded to the input dtype once (per-row casts rounded dK to bfloat16 after every row: 2.5x the
            # same-dtype reference's error, bench.measure.oracle.numerics)
            k_acc = k.to(acc)
            if needs_grad:
                # Autograd through n in-place writes into one (B, H, N, N) tensor copies its gradient n times
                # (O(N^3)); under autograd build the rows apart and stack them.
                rows = []
                for i in range(nq):
                    row = torch.full((b, h, n), -math.inf, dtype=acc, device=q.device)
                    row[:, :, keys[i]] = row_scores(i, k_acc)
                    rows.append(row)
                attn = torch.stack(rows, dim=2)
            else:  # the seed's loop, with -inf instead of 0 outside the window
                attn = torch.full((b, h, nq, n), -math.inf, dtype=acc, device=q.device)
                for i in range(nq):
                    attn[:, :, i, keys[i]] = row_scores(i, k_acc)
            attn = torch.softmax(attn * scale, dim=-1).nan_to_num(0.0)  # an empty row is all -inf: zeros
            out = attn.view(b, hkv, -1, n) @ v.to(acc)  # (B, Hkv, G*Nq, D)
            return out.view(b, h, nq, d).to(q.dtype)

        return call

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection, row by row: each query row's scores against every key, -inf outside the
        row's effective mask (per batch and head, so no per-row key list is precomputed)."""
        with setup_phase("mask"):
            base = pattern.dense_mask().to(q.device)  # (Nq, N)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]

        def attend(selection):
            mask = selection.dense_mask(base, h, hkv)  # (B, H, Nq, N)
            rows = []
            for i in range(nq):
                row = q[:, :, i, :].reshape(b, hkv, h // hkv, d)  # (B, Hkv, G, D)
                scores = (row.to(acc) @ k.to(acc).transpose(-2, -1)).reshape(b, h, n)
                rows.append(scores.masked_fill(~mask[:, :, i], -math.inf))
            attn = torch.softmax(torch.stack(rows, dim=2) * scale, dim=-1).nan_to_num(0.0)
            out = attn.view(b, hkv, -1, n) @ v.to(acc)
            return out.view(b, h, nq, d).to(q.dtype)

        return attend
