"""The AMX commands as a user runs them: `chainfuse plan --dtype bf16` and `chainfuse hw` say the
AMX path and state, the AMX micro-kernel benchmark refuses without AMX (or runs the emulation
with --emulate), and scripts/amx_check.sh runs on any host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chainfuse.bench import amx, runner
from chainfuse.bench.report import summary_rows
from chainfuse.bench.results import Result
from chainfuse.kernels.amx import ENV_AMX, AmxPath, amx_status
from chainfuse.runtime import CompileError, build

ROOT = Path(__file__).resolve().parents[2]
HAS_AMX = amx_status()[0]


def run(*args: str, amx_mode: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHON"] = sys.executable
    env.pop(ENV_AMX, None)
    if amx_mode is not None:
        env[ENV_AMX] = amx_mode
    cmd = list(args) if args[0] == "bash" else [sys.executable, "-m", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                          check=False)  # fmt: skip


def test_plan_names_the_amx_path_on_an_amx_preset() -> None:
    proc = run("chainfuse", "plan", "bert-base", "--dtype", "bf16", "--hw", "xeon-8480")
    assert proc.returncode == 0, proc.stderr
    assert "register block 32x32" in proc.stdout and "arithmetic: amx-bf16" in proc.stdout
    proc = run("chainfuse", "plan", "bert-base", "--dtype", "bf16", "--hw", "xeon-gold-6240")
    assert proc.returncode == 0, proc.stderr
    assert "arithmetic: fp32-fma" in proc.stdout and "32x32" not in proc.stdout


def test_hw_says_the_amx_state() -> None:
    proc = run("chainfuse", "hw", amx_mode="emulate")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("AMX: "))
    assert line.startswith("AMX: available" if HAS_AMX else ("AMX: no AMX", "AMX: permission"))
    assert "CHAINFUSE_AMX=emulate" in line
    proc = run("chainfuse", "hw", "--hw", "xeon-8480")
    assert "AMX tiles 8 x 1 KiB" in proc.stdout and "planning only" in proc.stdout


@pytest.mark.skipif(HAS_AMX, reason="this host has AMX: the refusal is for hosts without")
def test_amx_microkernel_bench_refuses_without_amx_unless_emulated() -> None:
    proc = run("chainfuse.bench.microkernel", "--isa", "amx")
    assert proc.returncode == 2 and "no AMX" in proc.stderr and "--emulate" in proc.stderr
    proc = run("chainfuse.bench.microkernel", "--isa", "amx", "--emulate", "--kc", "32")
    assert proc.returncode == 0, proc.stderr
    assert "amx-bf16 (emulated)" in proc.stdout and "not the unit's speed" in proc.stdout


def test_amx_probe_is_never_the_emulation() -> None:
    assert (amx.probe_gflops(seconds=0.01, repeat=1) is None) is not HAS_AMX
    bench = amx.measure(AmxPath.EMULATED, kc=64)  # checked against numpy inside
    assert bench.probe_gflops is None and bench.max_error < 1e-4
    try:  # the unit's build compiles on any host whose compiler takes -mamx-tile (no run)
        build(amx.amx_source(), "bench_amx", AmxPath.REAL.cflags)
    except CompileError as err:
        if "amx" in err.stderr and "unrecognized" in err.stderr:
            pytest.skip(f"the compiler has no AMX flags: {err.stderr.strip()[:200]}")
        raise


def test_bench_says_why_bf16_is_of_the_fp32_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    extra: dict[str, object] = {}
    monkeypatch.setenv(ENV_AMX, "emulate")
    assert runner._amx_probe(["bfloat16"], extra, "before") is None
    assert "emulate" in str(extra["amx"])
    assert runner._amx_probe(["float32"], {}, "before") is None
    if not HAS_AMX:
        monkeypatch.setenv(ENV_AMX, "auto")
        assert runner._amx_probe(["bfloat16"], extra, "before") is None
        assert str(extra["amx"]).startswith("no AMX")


def test_summary_counts_bf16_cases_against_the_amx_peak() -> None:
    r = Result("attention-bf16", "w", "softmax", 1, 1.0, {"chainfuse": 1.0, "torch": 2.0},
               ("torch",))  # fmt: skip
    fp32 = summary_rows([r], 1.0)[0]  # 1000 GFLOP/s against a peak of 1
    amx_peak = summary_rows([r], 1.0, {"attention-bf16": (2000.0, "AMX")})[0]
    assert fp32["at_or_above_80pct_peak"] == 1 and amx_peak["at_or_above_80pct_peak"] == 0
    assert amx_peak["peak"] == "AMX"


def test_amx_check_script_runs_here() -> None:
    proc = run("bash", "scripts/amx_check.sh", "--smoke")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "amx-bf16 (emulated)" in out
    for suite in ("gemm-chain", "attention", "mlp"):
        assert f"{suite}" in out and "1t: geomean" in out
