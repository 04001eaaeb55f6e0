"""`bench ab`: the measurement of every (case, impl) of both sides (called by bench.run.ab.command.measure_ab).

A pair both sides have is opened on both at once, warmed untimed on each, timed in R rounds of one block per
side in a drawn order, and closed on both at once; a distributed pair, a pair timed through the Triton
interpreter, or a pair one side ended early, is measured once per side without interleaving; a pair of one side
only is measured as `bench run` does.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bench.results.records import Record
from bench.results.store import utc_now
from bench.run import messages
from bench.run.ab.side import (
    BUDGET_FACTOR,
    DISTRIBUTED,
    ENDED,
    INTERLEAVED,
    INTERPRETER,
    ONE_SIDE,
    RANKS_SLACK_S,
    WARM_BLOCKS,
    ABMeasurement,
    ABOptions,
    Key,
    PairMeasurement,
    Side,
    failed_record,
    read_record,
)
from bench.run.console import Reporter
from bench.run.worker import Outcome


def measure_pairs(sides: list[Side], options: ABOptions, console: Console,
                  describe: Callable[[PairMeasurement], str] | None,
                  open_keys: Callable[[list[PairMeasurement], list[int]], set[Key]] | None = None,
                  started: float | None = None) -> ABMeasurement:
    """Every pair once (the first look, R rounds); then, while some pairs' verdicts are open (`open_keys`) and
    the budget lasts, one more look: a trial of R more rounds of each open pair on fresh workers (both sides
    restarted at once), up to the planned looks (options.looks()). A state that favours one worker process for
    seconds (its memory layout, where the scheduler put it) can fake a large change in the pairs measured
    meanwhile; it does not survive new processes and a later moment, a real change does."""
    started = time.perf_counter() if started is None else started
    base, new = sides
    assert base.loaded is not None and new.loaded is not None
    b_pairs = {(p.case_id, p.impl): p for p in base.loaded.pairs}
    n_pairs = {(p.case_id, p.impl): p for p in new.loaded.pairs}
    keys = list(dict.fromkeys([*n_pairs, *b_pairs]))
    reporter = Reporter(len(keys), console)
    looks = options.looks()
    budget_s = options.budget_s
    left_open = 0
    try:
        pairs, only_base, only_new = _first_pass(base, new, keys, b_pairs, n_pairs, options, reporter, describe)
        if budget_s is None:
            budget_s = BUDGET_FACTOR * (time.perf_counter() - started)
        if open_keys is not None:
            left_open = _later_looks(base, new, pairs, looks, open_keys, b_pairs, n_pairs, options, reporter,
                                     describe, started + budget_s)
    finally:
        reporter.close()
    assert base.run is not None and new.run is not None
    return ABMeasurement(base.run, new.run, pairs, only_base, only_new, options.rounds, options.block_s,
                         options.block_calls, 0.0, options.threads, base.cpus, looks=looks, budget_s=budget_s,
                         left_open=left_open)


def _first_pass(base: Side, new: Side, keys: list[Key], b_pairs: dict[Key, messages.SuitePair],
                n_pairs: dict[Key, messages.SuitePair], options: ABOptions, reporter: Reporter,
                describe: Callable[[PairMeasurement], str] | None
                ) -> tuple[list[PairMeasurement], list[PairMeasurement], list[PairMeasurement]]:
    """Every pair once: interleaved where both sides have it (records written), measured alone where one has."""
    pairs: list[PairMeasurement] = []
    only_base: list[PairMeasurement] = []
    only_new: list[PairMeasurement] = []
    for key in keys:
        bp, np_ = b_pairs.get(key), n_pairs.get(key)
        label = (np_ or bp).label  # type: ignore[union-attr]
        reporter.start(label, key[1])
        if bp is not None and np_ is not None:
            pm = _measure_common(base, new, bp, np_, options)
            pairs.append(pm)
        else:
            side, sp = (base, bp) if bp is not None else (new, np_)
            assert sp is not None
            record = _measure_alone(side, sp)
            side.write(record)
            pm = PairMeasurement(sp.case_id, sp.impl, label, ONE_SIDE, record if side is base else None,
                                 record if side is new else None)
            (only_base if side is base else only_new).append(pm)
        reporter.finish_line(describe(pm) if describe else _describe(pm))
    return pairs, only_base, only_new


def _later_looks(base: Side, new: Side, pairs: list[PairMeasurement], looks: list[int],
                 open_keys: Callable[[list[PairMeasurement], list[int]], set[Key]],
                 b_pairs: dict[Key, messages.SuitePair], n_pairs: dict[Key, messages.SuitePair], options: ABOptions,
                 reporter: Reporter, describe: Callable[[PairMeasurement], str] | None, deadline: float) -> int:
    """The looks after the first, while pairs are open and before the deadline; how many pairs were left open."""
    given_up: set[Key] = set()  # a side failed in a later trial: its first trial's verdict stands
    for look in range(1, len(looks)):
        still_open = open_keys(pairs, looks)
        open_pairs = [pm for pm in pairs if pm.key in still_open and pm.key not in given_up
                      and len(pm.trials()) == look]
        if not open_pairs:
            return 0
        if time.perf_counter() >= deadline:
            return len(open_pairs)
        left_open = _add_look(base, new, open_pairs, looks[look] - looks[look - 1], b_pairs, n_pairs, options,
                              reporter, describe, deadline, given_up, look + 1)
        if left_open:
            return left_open
    return 0


def _add_look(base: Side, new: Side, open_pairs: list[PairMeasurement], rounds: int,
              b_pairs: dict[Key, messages.SuitePair], n_pairs: dict[Key, messages.SuitePair], options: ABOptions,
              reporter: Reporter, describe: Callable[[PairMeasurement], str] | None, deadline: float,
              given_up: set[Key], number: int) -> int:
    """One more trial of `rounds` rounds of each open pair, on fresh workers of both sides (started at once); no
    record is written. Returns how many open pairs the deadline left without it."""
    for side in (base, new):
        side.close()
    for side in (base, new):
        if side.start_failure is None:
            side.spawn()
    for side in (base, new):
        if side.worker is not None:
            side.ready()
    reporter.extend(len(open_pairs))
    for i, pm in enumerate(open_pairs):
        if time.perf_counter() >= deadline:
            reporter.extend(i - len(open_pairs))
            return len(open_pairs) - i
        reporter.start(pm.label, pm.impl)
        again = _measure_common(base, new, b_pairs[pm.key], n_pairs[pm.key], options, write=False, n_rounds=rounds,
                                trial=number)
        if again.mode == INTERLEAVED and again.rounds:
            pm.more_trials.append(again.rounds)
            pm.more_orders.append(again.orders)
            pm.more_records.append((again.base, again.new))
        else:
            given_up.add(pm.key)
        line = describe(pm) if describe else _describe(again)
        reporter.finish_line(f"trial {number}: {line}")
    return 0


def _describe(pm: PairMeasurement) -> str:
    head = f"{pm.label} | {pm.impl}: "
    if pm.mode == INTERLEAVED and pm.rounds:
        ratios = [min(n) / min(b) for b, n in pm.rounds if b and n]  # the fastest call of each block
        return head + f"NEW/BASE {statistics.median(ratios):.3f} over {len(ratios)} rounds"
    statuses = " | ".join(f"{name} {r.status}" for name, r in (("BASE", pm.base), ("NEW", pm.new)) if r is not None)
    return head + statuses + (f" ({pm.mode})" if pm.mode != ONE_SIDE else " (one side only)")


def _pair_seed(options: ABOptions, key: Key, trial: int) -> int:
    salt = "" if trial == 1 else f"#{trial}"  # the first trial's orders as before later trials existed
    digest = hashlib.sha256(f"{options.seed}:{key[0]}|{key[1]}{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def round_orders(rounds: int, rng: random.Random) -> list[str]:
    """As many BASE-first as NEW-first rounds (one more of either, drawn, when odd), shuffled."""
    orders = ["BN"] * (rounds // 2) + ["NB"] * (rounds // 2)
    if rounds % 2:
        orders.append(rng.choice(["BN", "NB"]))
    rng.shuffle(orders)
    return orders


def _measure_alone(side: Side, pair: messages.SuitePair) -> Record:
    """A pair of one side only, measured as `bench run` does."""
    started = utc_now()
    worker = side.start()
    if worker is None:
        return failed_record(pair, side.start_failure or "worker failed to start", "startup", started)
    if pair.world_size > 1:
        outcome = worker.measure_ranks_json(pair.task, side.timeout_s + RANKS_SLACK_S, _ranks_log(side))
    else:
        outcome = worker.measure_json(pair.task, side.timeout_s)
    if outcome.record is not None:
        return read_record(side, outcome.record)
    side.lost()
    return failed_record(pair, outcome.failure or "worker failed", outcome.kind, started)


def _ranks_log(side: Side) -> Path | None:
    return side.run.run_dir / "ranks.log" if side.run is not None else None


@dataclass
class _Pair:
    """One pair on both sides while it is measured: which sides' sessions are open, their final records where a
    side ended, how it is timed and why."""

    sides: dict[str, tuple[Side, messages.SuitePair]]
    session: dict[str, bool]
    finals: dict[str, Record | None]
    mode: str = INTERLEAVED
    note: str | None = None

    def end(self, name: str, lost: Outcome) -> None:
        self.finals[name] = failed_record(self.sides[name][1], lost.failure or "worker failed", lost.kind, utc_now())
        self.session[name] = False


def _measure_common(base: Side, new: Side, bp: messages.SuitePair, np_: messages.SuitePair,
                    options: ABOptions, write: bool = True, n_rounds: int | None = None, trial: int = 1
                    ) -> PairMeasurement:
    label = np_.label
    if bp.world_size > 1 or np_.world_size > 1:
        records = [_measure_alone(side, sp) for side, sp in ((base, bp), (new, np_))]
        for side, record in zip((base, new), records, strict=True):
            side.write(record)
        return PairMeasurement(bp.case_id, bp.impl, label, DISTRIBUTED, records[0], records[1],
                               note="distributed pair: fresh rank processes per measurement, so its time is "
                                    "measured once per side and not interleaved")
    opened = _open_both(base, new, bp, np_)
    pair = _Pair({"base": (base, bp), "new": (new, np_)}, {"base": opened[0] is None, "new": opened[1] is None},
                 {"base": opened[0], "new": opened[1]})
    if not (pair.session["base"] and pair.session["new"]):
        pair.mode, pair.note = ENDED, "a side ended before timing (skipped or failed): not interleaved"
    elif any(_interpreter(side) for side in (base, new)):
        pair.mode = INTERPRETER
        pair.note = "timed through the Triton interpreter on CPU (correctness only, not kernel speed): one block " \
                    "per side, not interleaved"
    if pair.mode == INTERLEAVED:
        _warm_both(pair, options)
    rounds: list[tuple[list[float], list[float]]] = []
    orders: list[str] = []
    if pair.mode == INTERLEAVED:
        rng = random.Random(_pair_seed(options, (bp.case_id, bp.impl), trial))
        rounds, orders = _interleave(pair, round_orders(options.rounds if n_rounds is None else n_rounds, rng),
                                     options)
    else:
        for name in ("base", "new"):
            side, _ = pair.sides[name]
            if pair.session[name]:
                got = _block(side, max(side.loaded.repeat if side.loaded else 3, options.block_calls), 0.0)
                if isinstance(got, Outcome):
                    pair.end(name, got)
    closed = _close_both(base, new, bp, np_, pair.session)
    for name, owner in (("base", base), ("new", new)):
        final = pair.finals[name] if closed[name] is None else closed[name]
        assert final is not None
        pair.finals[name] = final
        if write:
            owner.write(final)
    return PairMeasurement(bp.case_id, bp.impl, label, pair.mode, pair.finals["base"], pair.finals["new"], rounds,
                           orders, pair.note)


def _warm_both(pair: _Pair, options: ABOptions) -> None:
    """Untimed, each side alone: the first calls after an open are slow."""
    for name in ("base", "new"):
        side, _ = pair.sides[name]
        lost = side.worker.warm(options.block_calls, WARM_BLOCKS * options.block_s, side.timeout_s) \
            if side.worker is not None else Outcome(None, "worker process lost", "warm-up", "died")
        if lost is not None:
            side.lost()
            pair.end(name, lost)
            pair.mode, pair.note = ENDED, "a side failed during its warm-up: not interleaved"


def _interleave(pair: _Pair, round_order: list[str], options: ABOptions
                ) -> tuple[list[tuple[list[float], list[float]]], list[str]]:
    """The rounds: one block per side in each, in the drawn order; none kept when a side fails among them."""
    rounds: list[tuple[list[float], list[float]]] = []
    orders: list[str] = []
    for order in round_order:
        samples: dict[str, list[float]] = {}
        for name in ("base", "new") if order == "BN" else ("new", "base"):
            got = _block(pair.sides[name][0], options.block_calls, options.block_s)
            if isinstance(got, Outcome):
                pair.end(name, got)
                break
            samples[name] = got
        if len(samples) < 2:
            pair.mode, pair.note = ENDED, "a side failed during the rounds; the rounds before it are not compared"
            return [], []
        rounds.append((samples["base"], samples["new"]))
        orders.append(order)
    return rounds, orders


def _open_both(base: Side, new: Side, bp: messages.SuitePair, np_: messages.SuitePair) -> list[Record | None]:
    """Open the pair on both sides at once; per side None (open, warm) or its final record."""
    started = utc_now()
    sent: list[tuple[Side, messages.SuitePair, bool]] = []
    finals: list[Record | None] = []
    for side, sp in ((base, bp), (new, np_)):
        worker = side.start()
        if worker is None:
            sent.append((side, sp, False))
            continue
        warmup = side.loaded.warmup if side.loaded is not None else 1
        failed = worker.send(messages.OpenForwarded(task=sp.task, warmup=warmup))
        if failed is not None:
            side.lost()
        sent.append((side, sp, failed is None))
    for side, sp, ok in sent:
        if not ok or side.worker is None:
            reason = side.start_failure or "worker process died before the open started"
            finals.append(failed_record(sp, reason, "startup" if side.start_failure else "died", started))
            continue
        answer, outcome = side.worker.await_answer(side.timeout_s, messages.Opened)
        if answer is None:
            side.lost()
            finals.append(failed_record(sp, outcome.failure or "worker failed", outcome.kind, started))
        elif answer.record is not None:
            finals.append(read_record(side, answer.record))
        else:
            finals.append(None)
    return finals


def _interpreter(side: Side) -> bool:
    assert side.worker is not None
    info = side.worker.describe(side.timeout_s)
    if isinstance(info, Outcome):
        side.lost()
        return False
    return info.interpreter


def _block(side: Side, calls: int, min_s: float) -> list[float] | Outcome:
    if side.worker is None:
        return Outcome(None, "worker process lost", "timing", "died")
    got = side.worker.block(calls, min_s, side.timeout_s)
    if isinstance(got, Outcome):
        side.lost()
    return got


def _close_both(base: Side, new: Side, bp: messages.SuitePair, np_: messages.SuitePair,
                session: dict[str, bool]) -> dict[str, Record | None]:
    """Close the open pair on both sides at once (memory, the record)."""
    out: dict[str, Record | None] = {"base": None, "new": None}
    waiting = []
    for name, side, sp in (("base", base, bp), ("new", new, np_)):
        if not session[name] or side.worker is None:
            continue
        failed = side.worker.send(messages.Close(), "memory")
        if failed is not None:
            side.lost()
            out[name] = failed_record(sp, failed.failure or "worker died", failed.kind, utc_now())
            continue
        waiting.append((name, side, sp))
    for name, side, sp in waiting:
        assert side.worker is not None
        answer, outcome = side.worker.await_answer(side.timeout_s, messages.RecordDone, "memory")
        if answer is None:
            side.lost()
            out[name] = failed_record(sp, outcome.failure or "worker failed", outcome.kind, utc_now())
        else:
            out[name] = read_record(side, answer.record)
    return out
