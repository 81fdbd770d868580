"""`chainfuse bench` end to end: a tiny run writes the report, the plots and the JSON.

Figures are not checked (timing belongs in benchmarks); that the files are there, that every
timed case appears in them, and that the numbers are sane (positive, finite) is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from chainfuse.cli import main


def test_bench_attention_quick_writes_the_report(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    argv = ["bench", "attention", "--quick", "--threads", "1", "--rounds", "2", "--top", "2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    md = (out / "report.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert len(list(out.glob("*.png"))) >= 3
    cases = {r["workload"] for r in data["results"]}
    assert {"seq-32", "seq-64", "seq-128", "decode-512", "causal-1024"} <= cases
    assert len(cases) == 7
    causal = next(r for r in data["results"] if r["workload"] == "causal-1024")
    assert causal["variant"] == "causal" and causal["gflop"] < 0.51 * 4 * 12 * 1024**2 * 64 / 1e9
    for r in data["results"]:
        assert r["threads"] == 1 and set(r["ms"]) == {"chainfuse", "sdpa", "unfused"}
        assert all(0 < v < math.inf for v in r["ms"].values())
        assert r["predicted_bytes"] and r["planning_ms"] > 0
        assert r["workload"] in md
    (fid,) = data["fidelity"]
    assert len(fid["measured_ms"]) == 2 and fid["tuning_gap"] >= 0
    assert "Spearman" in md and data["machine"]["fp32_peak_gflops_per_core_measured"] > 0
    # the peak the report divides by: the better of the probes before and after the timings
    probes = data["fp32_probe_gflops"]
    assert data["machine"]["fp32_peak_gflops_per_core_measured"] == max(probes.values())
    assert set(data["predicted_vs_measured_rho"]) == {"attention"}


def test_bench_half_precision_attention_is_its_own_suite(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    argv = ["bench", "attention", "--quick", "--threads", "1", "--rounds", "2", "--top", "0",
            "--dtype", "fp16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert {r["suite"] for r in data["results"]} == {"attention-fp16"}
    assert all(r["dtype"] == "float16" for r in data["results"])
    assert "attention_fp16_headline_figures" in data
