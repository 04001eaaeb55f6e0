"""Multi-query associative recall (MQAR), seeded: the task the built-in model `micro-mqar` answers.

MQAR is Zoology's recall task (HazyResearch/zoology, `zoology/data/associative_recall.py`, "multiquery_ar";
Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language Models"). Here its pairs are
spread over the whole context rather than packed at its start, so that the key a query needs may sit anywhere
in it, usually far from the query:

    f f k1 v1 f f f ... f k2 v2 f ... kP vP f f  q1 a1 q2 a2 ... qQ aQ
    '------------- context: N - 2Q tokens ----------'  '---- queries: 2Q ----'

- the context holds P key-value pairs (a key token followed by its value token) at start positions drawn
  uniformly over the context (non-overlapping), filler tokens everywhere else;
- the last 2Q tokens are Q queries, each a key seen in the context (distinct keys, random order) followed by its
  answer, the value that followed that key in the context. The model must predict the answer at the query's
  position (next-token prediction): `input_ids[s, query_positions[s, i] + 1] == answers[s, i]`.

The vocabulary has three disjoint ranges (MqarVocab): filler tokens [0, F), keys [F, F + K), values
[F + K, F + K + V). Keys and values are drawn without replacement within a sample, as in Zoology, so every key
appears once in the context and the answer is unambiguous.

The number of pairs grows with the length unless given: P = clamp(N // 64, 4, K) (one pair per 64 tokens on
average: 4 at 256 tokens, 16 at 1024, 64 from 4096 on), Q = min(P, 16). Any N from 64 on is valid (8192 and
beyond: P stays at K). Batches come from a torch.Generator seeded with the given int on the CPU, so a seed
gives the same batch on every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MqarVocab:
    """Token ranges: filler [0, filler), keys [filler, filler + keys), values after the keys."""

    filler: int = 16
    keys: int = 64
    values: int = 64

    @property
    def key_offset(self) -> int:
        return self.filler

    @property
    def value_offset(self) -> int:
        return self.filler + self.keys

    @property
    def size(self) -> int:
        return self.filler + self.keys + self.values


@dataclass(frozen=True)
class MqarBatch:
    """S samples of N tokens with Q queries each.

    input_ids: (S, N) int64. query_positions: (S, Q), the query key's position (predict the next token there).
    answers: (S, Q), the value that must come next. key_positions: (S, Q), where the queried key sits in the
    context (its value is at key_positions + 1).
    """

    input_ids: torch.Tensor
    query_positions: torch.Tensor
    answers: torch.Tensor
    key_positions: torch.Tensor
    num_pairs: int
    vocab: MqarVocab

    @property
    def value_positions(self) -> torch.Tensor:
        return self.key_positions + 1


def default_num_pairs(seq_len: int, vocab: MqarVocab = MqarVocab()) -> int:
    """P = clamp(seq_len // 64, 4, number of keys)."""
    return max(4, min(vocab.keys, vocab.values, seq_len // 64))


def default_num_queries(num_pairs: int) -> int:
    """Q = min(P, 16)."""
    return min(num_pairs, 16)


def make_batch(seq_len: int, samples: int, *, seed: int, num_pairs: int | None = None,
               num_queries: int | None = None, vocab: MqarVocab = MqarVocab()) -> MqarBatch:
    """`samples` MQAR sequences of `seq_len` tokens, the same for the same arguments on any machine."""
    pairs = default_num_pairs(seq_len, vocab) if num_pairs is None else num_pairs
    queries = default_num_queries(pairs) if num_queries is None else num_queries
    context = seq_len - 2 * queries
    if not 1 <= queries <= pairs <= min(vocab.keys, vocab.values):
        raise ValueError(f"need 1 <= queries ({queries}) <= pairs ({pairs}) <= min(keys, values) of the vocabulary")
    if context < 2 * pairs:
        raise ValueError(f"{pairs} pairs and {queries} queries do not fit in {seq_len} tokens")
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    s = samples

    def draw(n: int, k: int) -> torch.Tensor:
        """k of range(n) without replacement for each sample, (s, k), in random order."""
        return torch.rand(s, n, generator=g).argsort(dim=1, stable=True)[:, :k]

    keys = draw(vocab.keys, pairs) + vocab.key_offset
    values = draw(vocab.values, pairs) + vocab.value_offset
    # Non-overlapping pair starts uniform over the context: P sorted draws from range(context - P), the i-th
    # shifted by i (each pair takes one more slot than a start), which spreads them over the whole context.
    starts = draw(context - pairs, pairs).sort(dim=1).values + torch.arange(pairs)
    ids = torch.randint(0, vocab.filler, (s, seq_len), generator=g)
    rows = torch.arange(s)[:, None]
    ids[rows, starts] = keys
    ids[rows, starts + 1] = values
    asked = draw(pairs, queries)  # which pairs the queries ask for, in asking order
    query_positions = context + 2 * torch.arange(queries).expand(s, queries)
    answers = values.gather(1, asked)
    ids[rows, query_positions] = keys.gather(1, asked)
    ids[rows, query_positions + 1] = answers
    return MqarBatch(input_ids=ids, query_positions=query_positions.contiguous(), answers=answers,
                     key_positions=starts.gather(1, asked), num_pairs=pairs, vocab=vocab)


@torch.no_grad()
def answer_logits(model: torch.nn.Module, batch: MqarBatch, chunk: int = 8) -> torch.Tensor:
    """The model's logits at the query positions, (S, Q, vocab), run `chunk` samples at a time.

    `model(input_ids)` must return an object with `.logits` (S, N, vocab), as Hugging Face causal LMs do.
    """
    out = []
    for i in range(0, batch.input_ids.shape[0], chunk):
        ids = batch.input_ids[i:i + chunk]
        positions = batch.query_positions[i:i + chunk]
        # Only the logits at the query positions: the hidden states of the rest go nowhere.
        logits = model(ids.to(_device(model)), logits_to_keep=_keep(ids.shape[1], positions)).logits
        start = ids.shape[1] - logits.shape[1]
        index = (positions - start).to(logits.device)
        out.append(logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1])).float().cpu())
    return torch.cat(out)


def _keep(seq_len: int, positions: torch.Tensor) -> int:
    return seq_len - int(positions.min())


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def correct(model: torch.nn.Module, batch: MqarBatch, chunk: int = 8) -> torch.Tensor:
    """(S, Q) bool: the model's most likely next token at each query is its answer."""
    return answer_logits(model, batch, chunk).argmax(-1) == batch.answers


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for the default z)."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # At 0 or all successes a bound is exactly 0 or 1: say so rather than leave a rounding error.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return (low, high)
