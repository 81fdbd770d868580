"""A decoding loop against SDPA: one query, a new key length every step, 1 thread.

    python -m chainfuse.bench.decode_loop HEADS DIM FIRST LAST [view|cat] [mask] [layers=N]

Keys FIRST..LAST-1 of a cache: `view` slices it (strides stay), `cat` copies each step's keys
into new tensors (as a cache grown by concatenation does: strides grow too); `mask` adds a
float padding mask [1, 1, 1, keys]; `layers=N` makes each step N calls, one a layer, each on
its layer's own cache (as a decoder's layers do; default 1). A warm-up pass plans the buckets
of key lengths; then three passes time chainfuse and SDPA back to back on every step (which one
goes first alternates), with the memory of exact repeat calls cleared before each pass, as a
decoder sees each length once. Prints the time per call of each and the speedup over SDPA.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

import chainfuse
import chainfuse.ops as ops
import chainfuse.torch as cft

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Time the decoding loop `argv` describes (the module docstring) and print the speedup."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    heads, dim, first, last = (int(a) for a in argv[:4])
    words = argv[4:]
    layers = 1
    for word in words:
        if word.startswith("layers="):
            layers = int(word.split("=", 1)[1])
    mode = " ".join(w for w in words if not w.startswith("layers=")) or "view"
    chainfuse.set_num_threads(1)
    torch.set_num_threads(1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    caches = [(torch.randn(1, heads, last, dim), torch.randn(1, heads, last, dim))
              for _ in range(layers)]  # fmt: skip
    pad = torch.zeros(1, 1, 1, last) if "mask" in mode else None
    q = torch.randn(1, heads, 1, dim)

    def step(n: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        cache_k, cache_v = caches[layer]
        k, v = cache_k[:, :, :n], cache_v[:, :, :n]
        if "cat" in mode:
            k, v = k.clone(), v.clone()
        return k, v, None if pad is None else pad[..., :n].clone()

    for n in range(first, last):
        cft.attention(q, *step(n, 0))
    spent = {"chainfuse": 0.0, "sdpa": 0.0}
    for _ in range(3):
        ops.calls.replays.clear()
        for n in range(first, last):
            operands = [step(n, layer) for layer in range(layers)]
            for who in ("chainfuse", "sdpa") if n % 2 else ("sdpa", "chainfuse"):
                t0 = time.perf_counter()
                if who == "sdpa":
                    for k, v, m in operands:
                        sdpa(q, k, v, attn_mask=m)
                else:
                    for k, v, m in operands:
                        cft.attention(q, k, v, m)
                spent[who] += time.perf_counter() - t0
    calls = 3 * (last - first) * layers
    ours, theirs = spent["chainfuse"] / calls * 1e6, spent["sdpa"] / calls * 1e6
    print(
        f"{heads} heads x {dim}, keys {first}..{last - 1}, {mode}, {layers} layer(s): "
        f"chainfuse {ours:.1f} us/call, sdpa {theirs:.1f}, speedup {theirs / ours:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
