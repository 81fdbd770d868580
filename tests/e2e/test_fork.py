"""A `fork`-started worker calls chainfuse's kernels after PyTorch's own OpenMP threads ran in the
parent: the kernels share PyTorch's libgomp, whose workers do not survive a fork, so the child
must run them on one thread (with a warning), never wait for the lost workers forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import chainfuse

pytest.importorskip("torch")

REPO = Path(chainfuse.__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import warnings

    import numpy as np
    import torch

    import chainfuse
    from chainfuse import reference

    def work(queue):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = chainfuse.ops.attention(*args)
        forked = [w for w in caught if "was forked while" in str(w.message)]
        queue.put((np.asarray(out), len(forked)))

    chain = chainfuse.attention_chain(2, 4, 256, 256, 64, 64)
    inputs = reference.random_inputs(chain, seed=1)
    args = [inputs[t.name] for t in chain.inputs]
    want = reference.run(chain, inputs)[chain.outputs[0].name]
    torch.set_num_threads(2)
    x = torch.ones(1024, 1024)
    x @ x  # PyTorch's OpenMP team now exists in this process
    chainfuse.set_num_threads(2)  # (the child would use two threads without the guard)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=work, args=(queue,))
    child.start()
    got, warned = queue.get()
    child.join()
    reference.assert_close(got, want, chain)
    assert warned == 1, warned
    print("ok")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_after_torch_threads_does_not_hang() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("OMP_NUM_THREADS", None)
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a hung child is killed with it
    )
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("the fork-started child's chainfuse.ops.attention hung (60 s)")
    assert process.returncode == 0, err
    assert out.split() == ["ok"]
