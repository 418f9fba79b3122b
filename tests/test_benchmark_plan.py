# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/plan.py`'s report handling (`benchmarks/_plan_report.py`), no compiler needed:
`--update` replaces the rows planned again and keeps the others in place, and a row planned from
the model's first layers (`--depth`) renders its depths, its extrapolated step memory and no
cost-model estimate; a checkpoint's mxfp4 experts are named beside the weights' dtype."""

from __future__ import annotations

from tests.benchmark_scripts import load_benchmark

GIB = 1 << 30


plan = load_benchmark("plan")
plan_report = load_benchmark("_plan_report")


def _row(model: str, target: str, quantization: str = "none", tp_size: int = 1, **extra) -> dict:
    return {"model": model, "target": target, "quantization": quantization, "tp_size": tp_size, **extra}


def test_update_replaces_rows_planned_again_in_place_and_appends_new_ones():
    old = [
        _row("a", "v6e-1", note="old"),
        _row("a", "v6e-1", "int8", note="old"),
        _row("b", "h100x1", note="old"),
    ]
    new = [_row("a", "v6e-1", "int8", note="new"), _row("c", "v6e-8", tp_size=8, note="new")]
    rows = plan.updated(old, new)
    assert [(r["model"], r["quantization"], r["note"]) for r in rows] == [
        ("a", "none", "old"), ("a", "int8", "new"), ("b", "none", "old"), ("c", "none", "new"),
    ]  # fmt: skip


def test_a_row_planned_from_few_layers_renders_its_depths_and_extrapolated_memory():
    row = _row(
        "gpt-oss-120b", "v6e-8", tp_size=8, dtype="bfloat16", fits=True, depths=[2, 4],
        weight_bytes=8 * GIB, kv_bytes=19 * GIB, kv_tokens=1_000_000, batch=64, context=2048,
        batch_fits=True, overhead_bytes={"decode": GIB // 4, "prefill": GIB // 2},
        roofline={"seconds": 0.005, "tokens_per_second": 12800.0},
        decode_collectives={"count": 74, "bytes": 90 << 20}, short={"decode": [{}, {}], "prefill": [{}, {}]},
    )  # fmt: skip
    table = plan_report.render_markdown({"results": [row]})
    assert (
        "| gpt-oss-120b (from 2+4 layers) | v6e-8 | 8 | bfloat16 | 8.00 | 19.00 (1000000) | 0.25 / 0.50 | "
        "64 x 2048: fits | 5.0 (12800) | - | 74 (90.0) |"
    ) in table
    mxfp4 = plan_report.render_markdown({"results": [{**row, "mxfp4_experts": True}]})
    assert "| gpt-oss-120b (from 2+4 layers) | v6e-8 | 8 | bfloat16, mxfp4 experts | 8.00 |" in mxfp4
    one_chip = plan_report.markdown([{**row, "tp_size": 1}])
    assert (
        "| gpt-oss-120b (from 2+4 layers) | v6e-8 | bfloat16 | 8.00 | 19.00 (1000000) | 0.25 / 0.50 |"
        in one_chip
    )
    assert one_chip.endswith("| - | - |")
    # Weights alone over the budget: nothing was compiled, the row is the model's.
    too_large = {**row, "fits": False, "short": {}, "budget_bytes": 28 * GIB, "weight_bytes": 42 * GIB}
    assert (
        "| gpt-oss-120b | v6e-8 | 8 | bfloat16 | 42.00 | does not fit: weights 14.00 GiB over"
        in plan_report.render_markdown({"results": [too_large]})
    )


def test_data_parallel_rows_render_a_replicas_chip_and_the_tokens_of_all():
    roof = {"seconds": 0.02, "tokens_per_second": 3200.0}
    replicas = {
        "dp_size": 8, "tp_size": 1, "chips": 8, "experts_over_replicas": False, "weight_bytes": 15 * GIB,
        "kv_bytes": 13 * GIB, "kv_tokens": 105_184, "total_kv_tokens": 841_472, "batch_fits": False,
    }  # fmt: skip
    row = _row(
        "llama-3.1-8b", "v6e-8", dtype="bfloat16", fits=True, depths=[2, 4], weight_bytes=15 * GIB,
        kv_bytes=13 * GIB, kv_tokens=105_184, batch=64, context=2048, batch_fits=False, roofline=roof,
        overhead_bytes={"decode": GIB // 4, "prefill": GIB // 2}, decode_collectives={"count": 0, "bytes": 0},
        short={"decode": [{}, {}]}, dp_size=8, replicas=replicas,
    )  # fmt: skip
    table = plan_report.render_markdown({"results": [row]})
    assert (
        "| llama-3.1-8b (from 2+4 layers) | v6e-8 | DP 8 x TP 1 | bfloat16 | 15.00 | 13.00 (105184 a "
        "replica, 841472 in all) | 0.25 / 0.50 | 64 x 2048 a replica: no | 20.0 (25600 all replicas) | - | "
        "0 (0.0) |"
    ) in table
    # With the experts over the replicas the row is the replicas' own compiled program, with its
    # exchanges, whatever a replica's chips.
    exchanged = {"count": 192, "bytes": 110 << 20}
    for dp, tp in ((8, 1), (4, 2)):
        experts = {**replicas, "tp_size": tp, "dp_size": dp, "experts_over_replicas": True}
        compiled = plan_report.render_markdown(
            {"results": [{**row, "tp_size": tp, "replicas": experts, "decode_collectives": exchanged}]}
        )
        assert f"| DP {dp} x TP {tp}, EP 8 | bfloat16 |" in compiled
        total = dp * 25600 // 8
        assert compiled.endswith(f"| 20.0 ({total} all replicas) | - | 192 (110.0) |")
    # A row of replicas is its own plan beside the same model on one chip.
    assert plan.updated([_row("llama-3.1-8b", "v6e-8")], [row]) == [_row("llama-3.1-8b", "v6e-8"), row]
