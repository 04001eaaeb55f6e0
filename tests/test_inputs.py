"""The case field `inputs`: random (unchanged), the structured generator, captured files; attention statistics."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from bench.api import run as api_run
from bench.cli import main
from bench.inputs import InputsSpec, StructuredKnobs, make
from bench.inputs.files import file_sha256
from bench.inputs.structured import rope_frequencies, structured_inputs
from bench.measure.case.steps import make_inputs
from bench.measure.oracle.attention_stats import attention_statistics
from bench.patterns import make_pattern
from bench.spec.case import Case
from tests.conftest import only_run_dir, read_jsonl, run_bench, write_suite

SHAPE = dict(batch=1, heads=8, kv_heads=2, seq_len=1024, q_len=1024, head_dim=64, block_size=64)


def generate(seed: int = 0, **knobs: float) -> object:
    return structured_inputs(**SHAPE, seed=seed, knobs=StructuredKnobs(**knobs))


def stats_of(q: torch.Tensor, k: torch.Tensor, pattern: str = "causal") -> dict:
    n = k.shape[2]
    return attention_statistics(q, k, make_pattern(pattern, n, q_len=q.shape[2]), torch.arange(q.shape[2]), 64)


# --- the case field -----------------------------------------------------------------------------------------


def test_random_inputs_keep_the_case_ids_and_the_draw():
    plain = Case(seq_len=256, heads=2, head_dim=16)
    written = Case(seq_len=256, heads=2, head_dim=16, inputs="random")
    assert written.case_id == plain.case_id
    assert "inputs" in plain.params() and plain.params()["inputs"] == "random"
    # the draw of the earlier rounds: standard normals from seed * 1_000_003 on the device's generator
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(plain.q_shape(), generator=gen)
    assert torch.equal(make_inputs(plain.with_device("cpu")).q, q)


def test_structured_inputs_name_themselves_in_the_id_and_round_trip_through_params():
    case = Case(seq_len=256, heads=2, head_dim=16, inputs={"kind": "structured", "temperature": 2.0})
    assert "structured*" in case.case_id and case.case_id != Case(seq_len=256, heads=2, head_dim=16).case_id
    again = Case(**case.params())
    assert again == case and again.case_id == case.case_id
    assert Case(inputs="structured").case_id != case.case_id


@pytest.mark.parametrize("value, field", [
    ("gaussian", None), ({"kind": "structured", "sink": 3}, "sink"),
    ({"kind": "structured", "temperature": 0}, "temperature"), ({"kind": "magic"}, "kind"),
    ({"file": "x.safetensors"}, "layer"),
])
def test_bad_inputs_values_name_the_key(value, field):
    from bench.inputs import InputsError

    with pytest.raises(InputsError) as err:
        InputsSpec.parse(value)
    assert err.value.field == field


# --- the structured generator -------------------------------------------------------------------------------


def test_structured_inputs_are_deterministic_per_seed():
    a, b, c = generate(0), generate(0), generate(1)
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert a.needles == b.needles and a.head_kinds == b.head_kinds
    assert not torch.equal(a.q, c.q)


def test_structured_attention_is_concentrated_where_random_attention_is_flat():
    made = generate()
    structured = stats_of(made.q, made.k)
    flat = stats_of(torch.randn_like(made.q), torch.randn_like(made.k))
    assert flat["top5_mass"]["mean"] < 0.35 and flat["sink_mass"]["mean"] < 0.05
    assert structured["top5_mass"]["mean"] > 0.75
    assert structured["sink_mass"]["mean"] > 0.2
    assert structured["entropy"]["mean"] < flat["entropy"]["mean"] - 2.0


@pytest.mark.parametrize("knob, low, high, statistic", [
    ("temperature", 1.0, 3.0, "entropy"),      # a higher temperature flattens rows: entropy up
    ("sink_logit", 4.0, 10.0, "sink_mass"),    # sinks take more of each row
])
def test_each_knob_moves_its_statistic(knob, low, high, statistic):
    weak, strong = generate(**{knob: low}), generate(**{knob: high})
    assert stats_of(strong.q, strong.k)[statistic]["mean"] > stats_of(weak.q, weak.k)[statistic]["mean"] + 0.05


def test_heavy_hitters_take_mass_from_many_queries():
    from bench.measure.oracle.reference import reference_weights

    def heavy_mass(made) -> float:
        pattern = make_pattern("causal", SHAPE["seq_len"])
        rows = torch.arange(512, SHAPE["seq_len"])  # queries after every heavy hitter could have been seen
        total = sum(float(w[..., made.heavy_positions].sum(-1).mean()) for _, w in
                    reference_weights(made.q, made.k, pattern, rows))
        return total

    weak, strong = generate(heavy_logit=0.0, heavy_hitters=0.01), generate(heavy_logit=8.0, heavy_hitters=0.01)
    assert weak.heavy_positions == strong.heavy_positions and len(strong.heavy_positions) == 10
    assert heavy_mass(strong) > heavy_mass(weak) + 0.2


def test_the_local_logit_moves_mass_to_the_nearest_keys():
    weak, strong = generate(local_logit=2.0), generate(local_logit=10.0)
    assert float(_local_mass(strong.q, strong.k).mean()) > float(_local_mass(weak.q, weak.k).mean()) + 0.1


def _local_mass(q: torch.Tensor, k: torch.Tensor, width: int = 16) -> torch.Tensor:
    """Per query head: the mean share of causal attention within `width` keys of the query."""
    n, group = k.shape[2], q.shape[1] // k.shape[1]
    scores = (q[0] @ k[0].repeat_interleave(group, dim=0).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    scores = scores.masked_fill(distance < 0, -math.inf).softmax(-1)
    return (scores * ((distance >= 0) & (distance < width))).sum(-1)[:, 64:].mean(-1)


def test_heads_vary_by_kind_and_a_gqa_group_shares_its_kv_heads_kind():
    made = generate(local_heads=0.5, global_heads=0.5)
    local = _local_mass(made.q, made.k)  # (H,)
    group = SHAPE["heads"] // SHAPE["kv_heads"]
    kinds = [made.head_kinds[h // group] for h in range(SHAPE["heads"])]
    assert set(kinds) == {"local", "global"}
    on_local = local[[i for i, kind in enumerate(kinds) if kind == "local"]]
    on_global = local[[i for i, kind in enumerate(kinds) if kind == "global"]]
    assert on_local.min() > on_global.max()  # every query head follows its KV head's kind


def test_rope_makes_scores_decay_with_distance():
    made = generate(local_heads=1.0, global_heads=0.0, sinks=0, heavy_hitters=0.0, needles=0, noise=0.0)
    q, k = made.q[0, 0], made.k[0, 0]
    n = k.shape[0]
    by_distance = torch.tensor([float((q[d:] * k[: n - d]).sum(-1).mean()) / 8.0 for d in range(512)])
    assert abs(float(by_distance[0]) - 8.0) < 0.5  # local_logit at distance 0
    # averaged over bands of distance (one distance alone oscillates: RoPE's pairs fall out of phase and back)
    bands = [float(by_distance[a:b].mean()) for a, b in ((0, 1), (1, 4), (4, 16), (16, 64), (64, 512))]
    assert bands == sorted(bands, reverse=True) and bands[0] > 10 * abs(bands[-1])
    freqs = rope_frequencies(64, 500_000.0)
    assert freqs[0] == 1.0 and freqs[-1] < 1e-4  # real RoPE: theta^(-2i/D)


def test_planted_needles_are_recorded_and_attended_to():
    made = generate(needles=4, needle_queries=8)
    assert len(made.needles) == 4
    q, k = made.q[0], made.k[0]
    group = SHAPE["heads"] // SHAPE["kv_heads"]
    keys = k.repeat_interleave(group, dim=0)
    for needle in made.needles:
        assert needle.end - needle.start == 64 and len(needle.rows) == 8
        assert all(row >= needle.end for row in needle.rows)  # causal attention can reach it
        rows = torch.tensor(needle.rows)
        scores = (q[:, rows] @ keys.transpose(-1, -2)) / 8.0
        causal = torch.arange(k.shape[1])[None, :] <= rows[:, None]
        weights = scores.masked_fill(~causal, -math.inf).softmax(-1)
        assert float(weights[..., needle.start : needle.end].sum(-1).mean()) > 0.5


def test_a_decode_case_plants_its_needles_before_its_one_query():
    made = structured_inputs(**{**SHAPE, "q_len": 1}, seed=3, knobs=StructuredKnobs())
    assert made.q.shape[2] == 1 and made.needles
    assert all(needle.rows == (0,) and needle.end <= SHAPE["seq_len"] - 1 for needle in made.needles)


# --- files ------------------------------------------------------------------------------------------------


def write_capture(path, n: int = 256, heads: int = 4, kv_heads: int = 2, d: int = 16, layers=(0, 3)) -> None:
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in layers:
        tensors[f"layers.{layer}.q"] = torch.randn(1, heads, n, d, generator=gen)
        tensors[f"layers.{layer}.k"] = torch.randn(1, kv_heads, n, d, generator=gen)
        tensors[f"layers.{layer}.v"] = torch.randn(1, kv_heads, n, d, generator=gen)
    save_file(tensors, str(path), metadata={"model": "synthetic", "text_sha256": "0" * 64})


def test_file_inputs_take_a_prefix_of_the_tokens_and_the_last_queries(tmp_path):
    write_capture(tmp_path / "cap.safetensors")
    spec = InputsSpec(kind="file", file=str(tmp_path / "cap.safetensors"), layer=3,
                      sha256=file_sha256(tmp_path / "cap.safetensors"))
    from safetensors import safe_open

    from bench.inputs import InputsShape

    made = make(spec, InputsShape(1, 4, 2, 200, 8, 16, 64), 0, torch.bfloat16, "cpu")
    with safe_open(str(tmp_path / "cap.safetensors"), framework="pt") as f:
        q, k = f.get_tensor("layers.3.q"), f.get_tensor("layers.3.k")
    assert made.q.dtype == torch.bfloat16 and made.q.shape == (1, 4, 8, 16) and made.k.shape == (1, 2, 200, 16)
    assert torch.equal(made.q, q[:, :, 192:200].bfloat16()) and torch.equal(made.k, k[:, :, :200].bfloat16())
    assert made.info().file_sha256 == file_sha256(tmp_path / "cap.safetensors")


def test_a_suite_runs_file_and_structured_inputs_through_implementations_and_the_oracle(tmp_path):
    write_capture(tmp_path / "cap.safetensors")
    suite = {"name": "inputs-test", "impls": ["dense", "sdpa", "csr", "blocked"],
             "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "pattern": "causal", "seq_len": 256},
             "sweep": {"inputs": ["random", "structured", {"file": "cap.safetensors", "layer": 0}]},
             "measure": {"repeat": 2, "warmup": 0, "max_time_s": 0.2, "memory": "worker", "attention_stats": True}}
    records = api_run(write_suite(tmp_path, suite), out=tmp_path / "results", quiet=True)
    assert len(records) == 12 and all(r.status == "ok" for r in records), [r.reason for r in records]
    kinds = {r.inputs.kind for r in records}
    assert kinds == {"random", "structured", "file"}
    by_kind = {r.inputs.kind: r for r in records}
    assert by_kind["file"].inputs.file_sha256 == file_sha256(tmp_path / "cap.safetensors")
    assert by_kind["file"].inputs.layer == 0 and by_kind["structured"].inputs.needles > 0
    assert by_kind["structured"].attention_stats.top5_mass.mean > by_kind["random"].attention_stats.top5_mass.mean
    assert all(r.error.rows_checked == 256 for r in records)


def test_a_shape_disagreeing_with_the_file_names_the_file_the_tensor_and_both_shapes(tmp_path):
    write_capture(tmp_path / "cap.safetensors")
    suite = write_suite(tmp_path, {"name": "bad", "impls": ["dense"],
                                   "defaults": {"heads": 8, "kv_heads": 2, "head_dim": 16, "seq_len": 128,
                                                "inputs": {"file": "cap.safetensors", "layer": 0}},
                                   "sweep": {"seq_len": [128, 512]}})
    done = run_bench("run", str(suite), "--dry-run", "--out", str(tmp_path / "results"))
    assert done.returncode == 2, done.stderr
    assert "cap.safetensors" in done.stderr and "layers.0.q" in done.stderr
    assert "[1, 4, 256, 16]" in done.stderr and "[1, 8, 256, 16]" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_messages_of_bad_inputs(tmp_path, capsys):
    write_capture(tmp_path / "cap.safetensors")
    for inputs, words in [
        ({"file": "missing.safetensors", "layer": 0}, ["defaults.inputs.file", "no such file"]),
        ({"file": "cap.safetensors", "layer": 1}, ["defaults.inputs", "layers.1.q", "holds layers [0, 3]"]),
        ({"kind": "structured", "sinkz": 2}, ["defaults.inputs.sinkz", "unknown key", "sink_logit"]),
        ({"file": "cap.safetensors", "layer": 0, "sha256": "a" * 64}, ["defaults.inputs.sha256", "not the"]),
        ("learned", ["defaults.inputs", "'learned'", "allowed: 'random', 'structured'"]),
    ]:
        suite = write_suite(tmp_path, {"name": "bad", "impls": ["dense"],
                                       "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq_len": 128,
                                                    "inputs": inputs}})
        assert main(["run", str(suite), "--dry-run", "--out", str(tmp_path / "results")]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
    seq = write_suite(tmp_path, {"name": "bad", "impls": ["dense"],
                                 "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq_len": 300,
                                              "inputs": {"file": "cap.safetensors", "layer": 0}}})
    assert main(["run", str(seq), "--dry-run"]) == 2
    assert "holds 256 tokens" in capsys.readouterr().err


# --- the statistics command -----------------------------------------------------------------------------------


def test_bench_inputs_prints_random_and_structured_side_by_side(tmp_path):
    suite = write_suite(tmp_path, {"name": "stats", "impls": ["sdpa"],
                                   "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 32, "pattern": "causal",
                                                "seq_len": 512},
                                   "sweep": {"inputs": ["random", "structured"]}})
    done = run_bench("inputs", str(suite), "--json")
    assert done.returncode == 0, done.stderr
    import json

    results = json.loads(done.stdout)
    assert [r["inputs"]["kind"] for r in results] == ["random", "structured"]
    assert results[1]["top5_mass"]["mean"] > results[0]["top5_mass"]["mean"] + 0.3
    assert len(results[1]["by_head"]["top5_mass"]) == 4
    table = run_bench("inputs", str(suite), "--case", "1")
    assert table.returncode == 0 and "structured" in table.stdout and "top 5% keys" in table.stdout
    assert run_bench("inputs", str(suite), "--case", "7").returncode == 2


def test_a_run_records_where_its_inputs_came_from(tmp_path):
    suite = write_suite(tmp_path, {"name": "prov", "impls": ["dense"],
                                   "defaults": {"heads": 2, "head_dim": 16, "seq_len": 128, "seed": 3},
                                   "measure": {"repeat": 2, "memory": "worker"}})
    assert main(["run", str(suite), "--out", str(tmp_path / "results")]) == 0
    (record,) = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert record["inputs"] == {"kind": "random", "seed": 3, "file": None, "file_sha256": None, "layer": None,
                                "needles": None}
    assert record["attention_stats"] is None
