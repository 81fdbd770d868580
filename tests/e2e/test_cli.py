"""The `chainfuse` command, run as a user runs it: a subprocess of this interpreter."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from chainfuse.bench import workloads
from chainfuse.hardware import Hardware, presets
from chainfuse.planner import Plan, plan

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "chainfuse", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )


def test_plan_workload_prints_the_plan() -> None:
    proc = run("plan", "bert-base", "--hw", "xeon-gold-6240")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    expected = plan(workloads.chain_of("bert-base"), "xeon-gold-6240")
    assert "fused" in out
    assert " > ".join(expected.order) in out
    for level in Hardware.preset("xeon-gold-6240").levels:
        assert level.name in out
    assert "considered" in out


def test_plan_json_round_trips() -> None:
    proc = run("plan", "--gemm", "12,512,64,64,512", "--between", "softmax", "--json")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # plain JSON, nothing else on stdout
    parsed = Plan.from_json(proc.stdout)
    assert Plan.from_json(parsed.to_json()) == parsed
    assert parsed.to_json() == proc.stdout.strip()
    assert parsed.chain.startswith("gemm_softmax_gemm")


def test_plan_conv_json_round_trips() -> None:
    proc = run("plan", "1x1-1x1-a", "--hw", "xeon-gold-6240", "--json")
    assert proc.returncode == 0, proc.stderr
    parsed = Plan.from_json(proc.stdout)
    assert Plan.from_json(parsed.to_json()) == parsed


def test_plan_awkward_gemm_with_simulator() -> None:
    proc = run(
        "plan", "--gemm", "2,17,7,65,63", "--between", "relu", "--hw", "detect", "--simulate"
    )
    assert proc.returncode == 0, proc.stderr
    assert "simulated" in proc.stdout
    assert "relu" in proc.stdout


def test_hw_prints_levels() -> None:
    proc = run("hw")
    assert proc.returncode == 0, proc.stderr
    for level in Hardware.detect().levels:
        assert level.name in proc.stdout


def test_unknown_workload_lists_known_ones() -> None:
    proc = run("plan", "no-such-model")
    assert proc.returncode == 2
    assert "no-such-model" in proc.stderr
    for name in workloads.names():
        assert name in proc.stderr


def test_gemm_needs_five_sizes() -> None:
    proc = run("plan", "--gemm", "1,2,3")
    assert proc.returncode == 2
    assert "--gemm" in proc.stderr


def test_unknown_preset_lists_presets() -> None:
    proc = run("plan", "bert-base", "--hw", "nosuch")
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr
    for name in presets():
        assert name in proc.stderr


def test_zero_size_is_named() -> None:
    proc = run("plan", "--gemm", "0,1,1,1,1")
    assert proc.returncode == 2
    assert "batch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    assert scripts["chainfuse"] == "chainfuse.cli:main"
    module, _, attr = scripts["chainfuse"].partition(":")
    main = getattr(importlib.import_module(module), attr)
    assert main(["hw"]) == 0
    assert "L1" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_is_the_bench_parsers(flag: str) -> None:
    """`chainfuse bench --help` shows the suites and options: the top-level parser hands bench
    all of its arguments, a first one that looks like an option too."""
    proc = run("bench", flag)
    assert proc.returncode == 0, proc.stderr
    for option in ("--quick", "--threads", "--out", "attention", "gemm-chain"):
        assert option in proc.stdout


def test_bench_names_an_unknown_option() -> None:
    proc = run("bench", "--no-such-option")
    assert proc.returncode == 2
    assert "--no-such-option" in proc.stderr
    assert "Traceback" not in proc.stderr
