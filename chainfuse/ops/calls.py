"""What `ops` remembers between calls, in one object: `calls` (a `CallCache`).

A repeat call (same op, arguments, thread count, and operands of the same kinds, shapes,
strides and dtypes) runs from what its first call's checks found (`calls.replays`); a 4-D
attention call with another key length in a known bucket rechecks only k, v and the mask
(`calls.by_keys`). Kernels are kept by the plain sizes of their chains, so a call with known
sizes builds no chain. `calls.clear()` forgets everything; `calls.info()` says what is held.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from chainfuse import builders
from chainfuse.compiled import ConvKernel, Kernel
from chainfuse.compiler import compile, compile_conv, micro_kernel
from chainfuse.ir import Activation, Chain
from chainfuse.kernels.amx import ENV_AMX
from chainfuse.operands import TORCH_TYPES, Layout, apart, empty_like_input, is_torch, pointer
from chainfuse.ops.arguments import empty_result

__all__ = [
    "CacheInfo",
    "CallCache",
    "ConvReplay",
    "Kernels",
    "Memo",
    "Replay",
    "bucket_key",
    "bucketed",
    "calls",
    "key_bucket",
    "replay",
    "replay_conv",
    "replay_keys",
    "rows_vary",
    "run",
    "signature",
]

K = TypeVar("K")
V = TypeVar("V")
KT = TypeVar("KT")

#: entries a replay memory holds (as many as the kernel caches: an entry keeps its kernel alive)
REPLAYS_MAX = 256
#: kernels each cache of compiled kernels holds
KERNELS_MAX = 256


class Memo(dict[K, V]):
    """A dict of what earlier calls found, with a bound (`limit`) and counts of lookups that
    found an entry (`hits`) or did not (`misses`)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.hits = 0
        self.misses = 0

    def remember(self, key: K, value: V) -> None:
        """Keep `value` under `key`; a full memo is emptied first (calls repeat in runs)."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value

    def reset(self) -> None:
        """Forget every entry and the counts."""
        self.clear()
        self.hits = self.misses = 0


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """One cache of `CallCache`: entries held, its bound, lookups that hit and that missed."""

    size: int
    limit: int
    hits: int
    misses: int


class Replay(NamedTuple):
    """How a call ran, by what decided it (`calls.replays`' key): its kernel, where A, B, D (and
    the mask) are among the call's operands, the strides and mask strides the kernel's checks
    found, the result's shape, and whether the result is `empty_like` of the first operand."""

    kernel: Kernel
    at: tuple[int, ...]
    strides: tuple[int, ...]
    mask_strides: list[int] | None
    shape: tuple[int, ...]
    like: bool
    keys: int | None = None
    #: the `Layout`s of A, B, D [, the mask] and the result, by name: an `out=` is checked
    #: against them (`disjoint`)
    layouts: tuple[tuple[str, Layout], ...] = ()


class ConvReplay(NamedTuple):
    """How a conv chain ran (`calls.conv_replays`, by the same rule): its kernel, the strides its
    checks found, the result's shape, and whether a new result is channels-last (None: the
    call passed `out`)."""

    kernel: ConvKernel
    strides: tuple[int, ...]
    shape: tuple[int, ...]
    channels_last: bool | None
    #: the `Layout`s of x, w1, w2, b1, b2 and out, by name (`disjoint`)
    layouts: tuple[tuple[str, Layout], ...] = ()


def signature(xs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The operands' part of a `calls.replays` key (None: operands absent from the call), or None
    when they are not all numpy arrays or all plain CPU tensors outside autograd (nn.Parameter
    counts as plain, and requires_grad is no matter with grad mode off: a model's weights)."""
    kind = type(xs[0])
    key: list[Any] = [kind]
    if kind is np.ndarray:
        for x in xs:
            if x is None:
                key.append(None)
            elif type(x) is np.ndarray:
                key += (x.shape, x.strides, x.dtype, x.flags.writeable)
            else:
                return None
    elif kind in TORCH_TYPES or is_torch(xs[0]):
        torch = sys.modules["torch"]
        plain, grad = (kind, torch.Tensor, torch.nn.Parameter), torch.is_grad_enabled()
        try:
            for x in xs:
                if x is None:
                    key.append(None)
                elif type(x) in plain and x.is_cpu and not (grad and x.requires_grad):
                    key += (x.shape, x.stride(), x.dtype)
                else:
                    return None
        except (RuntimeError, NotImplementedError):  # (no strides: sparse; the checks name it)
            return None
    else:
        return None
    return tuple(key)


def amx_setting() -> str | None:
    """`CHAINFUSE_AMX` as set now: part of every key of the caches below, so that a change of it
    takes effect at the next call (the AMX kernels, or not) instead of replaying the kernel an
    earlier setting chose."""
    return os.environ.get(ENV_AMX)


def bucket_key(key: tuple[Any, ...], mask: Any) -> tuple[tuple[Any, ...], int] | None:
    """The `calls.by_keys` key of an attention call whose `calls.replays` key is `key`, and its
    number of keys; None unless q, k and v are 4-D. What decides the call's kernel and path
    stays: q whole, k's and v's shapes with the keys' bucket for their length, dtypes, and the
    mask's shape the same way (its last dim is the bucket when it is the keys'). What is left
    out (k's, v's and the mask's strides, and their lengths in the bucket) `replay_keys`
    checks."""
    sig = key[-1]
    w = 3 if sig[0] is not np.ndarray else 4  # fields an operand has in `signature`
    k_shape, v_shape = sig[1 + w], sig[1 + 2 * w]
    if len(k_shape) != 4 or len(v_shape) != 4:
        return None
    n = k_shape[2]
    bucket = key_bucket(n)
    head = (key[:-1], sig[: 1 + w], bucket, k_shape[0], k_shape[1], k_shape[3], sig[3 + w],
            v_shape[0], v_shape[1], v_shape[3], sig[3 + 2 * w])  # fmt: skip
    if mask is None:
        return head, n
    m_shape = sig[1 + 3 * w]
    if not m_shape:
        return None
    last = m_shape[-1]
    return (*head, tuple(m_shape[:-1]), bucket if last == n else last, sig[3 + 3 * w]), n


def key_bucket(n: int) -> int:
    """`n` keys rounded up to a bucket of lengths planned together: steps of an eighth of the
    power of two below (at least 8), so a plan covers at most 12.5 % more keys than a call has
    (7 more below 64), and a decoder's 1..4096 keys take 56 plans instead of 4096."""
    buckets = calls.buckets
    found = buckets.get(n)
    if found is None:
        buckets.misses += 1
        step = max(8, 1 << max(0, n.bit_length() - 4))
        found = -(-n // step) * step
        if len(buckets) < buckets.limit:
            buckets[n] = found
    else:
        buckets.hits += 1
    return found


def bucketed(
    sizes: tuple[int, int, int, int, int, int],
    causal: bool,
    mask: str | None,
    scale: float | None,
    mask_shape: tuple[int, ...] | None,
    dtype: str,
    threads: int,
    softcap: float | None = None,
) -> tuple[Kernel, int | None]:
    """The kernel for a call with `sizes` and the `keys` its calls pass (None: its own): a
    decoding step's key length is new every step, and planning one costs far more than the
    step, so the kernel is the one of the bucket's longest length (`key_bucket`), run with the
    call's (a mask's key dim follows, unless it broadcasts)."""
    seq_k = sizes[3]
    bucket = key_bucket(seq_k)
    if mask_shape is not None and mask_shape[-1] == seq_k:
        mask_shape = (*mask_shape[:-1], bucket)
    kernel = calls.attention_kernels((*sizes[:3], bucket, *sizes[4:]), causal, mask, scale,
                                     mask_shape, dtype, threads, amx_setting(), softcap)  # fmt: skip
    return kernel, None if bucket == seq_k else seq_k


def run(
    kernel: Kernel,
    inputs: tuple[Any, ...],
    out: Any,
    threads: int,
    key: tuple[Any, ...] | None,
    result: Any,
    like: bool,
    keys: int | None = None,
    by_keys: tuple[Any, ...] | None = None,
    packed_at: int = 0,
) -> None:
    """Check and run one kernel call on `inputs` (views of the caller's operands at the same
    addresses, in the same order) into `out` (a view of `result`), with `keys` of l (None:
    the kernel's own; see `bucketed`), and remember how under `key`, for `replay`, and
    under `by_keys` (`bucket_key`: then k, v and the mask are the caller's), for
    `replay_keys`. `packed_at`: the address of the weights packed once (`ops.packed`), or 0."""
    _, pointers, strides, mask_strides = kernel.bind(inputs, out, keys)
    kernel.launch(pointers, strides, mask_strides, threads, keys, packed_at)
    if key is not None or by_keys is not None:
        at = kernel.positions + ((kernel.mask_at,) if mask_strides is not None else ())
        at += kernel.extra_positions
        shape = tuple(int(s) for s in result.shape)
        layouts = tuple(kernel.layouts(inputs, out, keys))
        entry = Replay(kernel, at, strides, mask_strides, shape, like, keys, layouts)
        if key is not None:
            calls.replays.remember(key, entry)
        if by_keys is not None:
            calls.by_keys.remember(by_keys, entry)


def replay(r: Replay, operands: tuple[Any, ...], out: Any, threads: int, packed_at: int = 0) -> Any:
    """Run a call `run` ran before with operands like these: their pointers, its strides (and
    this call's packed weights, `packed_at`, as `run` takes them)."""
    given = out is not None
    if out is None:
        out = empty_result(operands[0], r.shape, r.like)
    at = r.at
    if type(out) is np.ndarray:
        ptr = pointer
        pointers = [ptr(operands[at[0]]), ptr(operands[at[1]]), ptr(operands[at[2]]), ptr(out)]
    else:  # tensors (of one kind: the key says so): their pointers without a helper's call
        pointers = [operands[at[0]].data_ptr(), operands[at[1]].data_ptr(),
                    operands[at[2]].data_ptr(), out.data_ptr()]  # fmt: skip
    for i in at[3:]:  # (the mask, then B3 and the biases)
        pointers.append(pointer(operands[i]))
    if given:  # (a new result shares memory with nothing)
        disjoint(pointers[3], [pointers[0], pointers[1], pointers[2], *pointers[4:]], r.layouts)
    r.kernel.launch(pointers, r.strides, r.mask_strides, threads, r.keys, packed_at)
    return out


def disjoint(e: int, inputs: list[Any], layouts: tuple[tuple[str, Layout], ...]) -> None:
    """A replay's check of the caller's `out=` at `e` against its inputs at new pointers, with
    the layouts its first call found (the key fixes them): the spans' comparisons only, unless
    they meet (`operands.apart` then decides, and names the input)."""
    out = layouts[-1][1]
    lo, hi = e + out[0], e + out[1]
    for p, (_, at) in zip(inputs, layouts, strict=False):  # (layouts end with out's)
        if p is not None and p + at[0] < hi and lo < p + at[1]:
            apart(
                (e, out),
                [(n, q, a) for q, (n, a) in zip(inputs, layouts, strict=False) if q is not None],
            )
            return


def replay_keys(
    r: Replay, operands: tuple[Any, ...], n: int, threads: int, key: tuple[Any, ...]
) -> Any:
    """Run a call `run` ran before with other k, v (and mask) of `n` keys in the same bucket
    (`bucket_key`): those checked again, q's pointer and the result's strides as they were; and
    remember it under its `calls.replays` key `key` (a decoder's other layers make the same call
    at this step). None when the checks fail: the checked path then names what is wrong."""
    kernel = r.kernel
    keys = None if n == kernel.planned_keys else n
    try:
        pointers, strides, mask_strides = kernel.bind_keys(r.strides, operands, keys)
    except (TypeError, ValueError):
        return None
    out = empty_result(operands[0], r.shape, r.like)
    q = operands[r.at[0]]
    if type(out) is np.ndarray:
        a, e = pointer(q), pointer(out)
    else:
        a, e = q.data_ptr(), out.data_ptr()
    kernel.launch([a, pointers[0], pointers[1], e, *pointers[2:]], strides, mask_strides,
                  threads, keys)  # fmt: skip
    calls.replays.remember(key, Replay(kernel, r.at, strides, mask_strides, r.shape, r.like, keys))
    return out


def replay_conv(
    r: ConvReplay, operands: tuple[Any, ...], out: Any, threads: int, packed: int | None = None
) -> Any:
    """Run a conv chain `conv_chain` ran before with operands like these (`packed`: the address
    of the weights packed once, `ConvKernel.launch`'s)."""
    given = out is not None
    if out is None:
        assert r.channels_last is not None
        out = empty_like_input(operands[0], r.shape, r.channels_last, r.kernel.dtype)
    ptr = pointer
    pointers = [None if x is None else ptr(x) for x in operands]
    if given:
        disjoint(ptr(out), pointers, r.layouts)
    pointers.append(ptr(out))
    r.kernel.launch(pointers, r.strides, threads, packed)
    return out


def _gemm_chain(
    sizes: tuple[int, int, int, int, int],
    between: Activation | str | None,
    dtype: str,
    threads: int,
    b_transposed: bool = False,
    d_transposed: bool = False,
    bias1: bool = False,
    bias2: bool = False,
    amx: str | None = None,
) -> tuple[Chain, int]:
    """A GEMM chain call's chain and the thread count its plan is made for (`amx`:
    `amx_setting`, a key)."""
    del amx
    chain = builders.gemm_chain(*sizes, between, dtype, b_transposed=b_transposed,
                                d_transposed=d_transposed, bias1=bias1, bias2=bias2)  # fmt: skip
    return chain, threads


def _gated_chain(
    sizes: tuple[int, int, int, int, int],
    act: Activation | str,
    dtype: str,
    threads: int,
    b_transposed: bool,
    d_transposed: bool,
    amx: str | None = None,
) -> tuple[Chain, int]:
    del amx
    chain = builders.gated_mlp_chain(*sizes, act, dtype, b_transposed=b_transposed,
                                     d_transposed=d_transposed)  # fmt: skip
    return chain, threads


def _attention_chain(
    sizes: tuple[int, int, int, int, int, int],
    causal: bool,
    mask: str | None,
    scale: float | None,
    mask_shape: tuple[int, ...] | None,
    dtype: str,
    threads: int,
    amx: str | None = None,
    softcap: float | None = None,
) -> tuple[Chain, int]:
    del amx
    chain = builders.attention_chain(*sizes, causal=causal, mask=mask, scale=scale,
                                     mask_shape=mask_shape, dtype=dtype, softcap=softcap)  # fmt: skip
    return chain, threads


def _planned(chain_of: ChainOf) -> Callable[..., Kernel]:
    """The builder of the kernel of `chain_of`'s chain, planned for its thread count."""

    def build(sizes: tuple[int, ...], *rest: Any) -> Kernel:
        chain, threads = chain_of(sizes, *rest)
        return compile(chain, threads=threads)

    return build


def _attention_rows(
    sizes: tuple[int, ...], rest: tuple[Any, ...], rows: int
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """An attention call's arguments with `rows` queries (a mask's query dim follows, unless it
    broadcasts)."""
    mask_shape = rest[3]
    if mask_shape is not None and len(mask_shape) >= 2 and mask_shape[-2] == sizes[2]:
        rest = (*rest[:3], (*mask_shape[:-2], rows, mask_shape[-1]), *rest[4:])
    return (*sizes[:2], rows, *sizes[3:]), rest


def _compile_conv(
    sizes: tuple[int, ...],
    between: str | None,
    after: str | None,
    dtype: str = "float32",
    amx: str | None = None,
    micro: str | None = None,
    threads: int | None = None,
) -> ConvKernel:
    """The compiled kernel of one conv chain, by its plain sizes (bf16: on AMX tiles; `amx`:
    `amx_setting`, a key; `micro`: the fp32 micro-kernel to run on, else the best; `threads`:
    the threads it runs on, which its bands are cut for)."""
    del amx
    N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, depthwise, pad2_after = sizes
    try:
        chain = builders.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=(st1, st2),
                                   padding=(pad1, pad2), between=between, dtype=dtype,
                                   depthwise=bool(depthwise), pad_after=pad2_after)  # fmt: skip
    except ValueError as err:
        if "never hits" not in str(err):
            raise
        raise ValueError(
            f"padding: every window of the second convolution along a dim reads only its "
            f"padding ({err}); not supported"
        ) from None
    return compile_conv(chain, threads=threads, after=after, micro=micro)


#: row counts at which `Kernels` asks which micro-kernel a chain's rows select under
#: `rows_vary`: each count up to 128 (where the kernels' column blocks of 16-64 part and tie),
#: then powers of two
ROW_PROBES = (*range(1, 129), *(1 << p for p in range(8, 17)))

_ROWS_VARY: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_vary", default=False)


@contextlib.contextmanager
def rows_vary() -> Iterator[None]:
    """Within: a kernel built or found for a call also builds, once per chain, the chain at the
    least row count of each other micro-kernel a row count selects for it (`Kernels`), so that
    calls of any later length build nothing: a graph compiled for every sequence length (the
    torch backend's dynamic graphs) pays its builds when it is compiled and first run."""
    token = _ROWS_VARY.set(True)
    try:
        yield
    finally:
        _ROWS_VARY.reset(token)


Resize = Callable[[tuple[int, ...], tuple[Any, ...], int], tuple[tuple[int, ...], tuple[Any, ...]]]
ChainOf = Callable[..., tuple[Chain, int]]


class Kernels(Generic[KT]):
    """Compiled kernels by their builder's arguments (`sizes`, then the rest), least recently
    used dropped past `KERNELS_MAX`. Where `chain_of` gives the chain of those arguments and
    `resize` the arguments at another row count, a call under `rows_vary` builds the other row
    counts' micro-kernels too (the FMA kernels' column blocks are the rows: on an AVX-512 host
    up to 16 rows take the 6x16 kernel, up to 63 the 12x32, more the 6x64)."""

    def __init__(
        self,
        build: Callable[..., KT],
        chain_of: ChainOf | None = None,
        resize: Resize | None = None,
    ) -> None:
        self._cached = functools.lru_cache(maxsize=KERNELS_MAX)(build)
        self._chain_of, self._resize = chain_of, resize
        self._done: set[tuple[Any, ...]] = set()  # chains (less their rows) whose rows are built

    def __call__(self, sizes: tuple[int, ...], *rest: Any) -> KT:
        kernel = self._cached(sizes, *rest)
        if self._chain_of is not None and self._resize is not None and _ROWS_VARY.get():
            self._other_rows(sizes, rest, self._chain_of, self._resize)
        return kernel

    def _other_rows(
        self, sizes: tuple[int, ...], rest: tuple[Any, ...], chain_of: ChainOf, resize: Resize,
    ) -> None:  # fmt: skip
        key = resize(sizes, rest, 0)
        if key in self._done:
            return
        self._done.add(key)
        seen = {micro_kernel(chain_of(sizes, *rest)[0])}
        for rows in ROW_PROBES:
            at, more = resize(sizes, rest, rows)
            name = micro_kernel(chain_of(at, *more)[0])
            if name not in seen:
                seen.add(name)
                self._cached(at, *more)

    def cache_info(self) -> Any:
        return self._cached.cache_info()

    def cache_clear(self) -> None:
        self._cached.cache_clear()
        self._done.clear()


def _rows_at(index: int) -> Resize:
    """`Kernels`' resize for arguments whose rows are `sizes[index]`."""

    def resize(
        sizes: tuple[int, ...], rest: tuple[Any, ...], rows: int
    ) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        return (*sizes[:index], rows, *sizes[index + 1 :]), rest

    return resize


class CallCache:
    """Every cache `ops` keeps between calls: replays of known calls and compiled kernels by
    their chains' sizes. `clear()` empties them all; `info()` reports each (`CacheInfo`)."""

    def __init__(self) -> None:
        #: calls made before, by everything that decides how they run (op, arguments, thread
        #: count, each operand's kind, shape, strides and dtype) -> how they ran (`Replay`)
        self.replays: Memo[tuple[Any, ...], Replay] = Memo(REPLAYS_MAX)
        #: 4-D attention calls by the same less k's, v's and the mask's strides and lengths,
        #: their key length's bucket instead (`bucket_key`) -> how one of them ran
        self.by_keys: Memo[tuple[Any, ...], Replay] = Memo(REPLAYS_MAX)
        #: conv chains called before, as `replays`
        self.conv_replays: Memo[tuple[Any, ...], ConvReplay] = Memo(REPLAYS_MAX)
        #: `key_bucket`'s answers
        self.buckets: Memo[int, int] = Memo(65536)
        #: compiled kernels by the plain arguments of their chains' builders and the thread
        #: count (the plan is made for it): building and verifying a chain costs more than a
        #: short call
        self.gemm_kernels = Kernels(_planned(_gemm_chain), _gemm_chain, _rows_at(1))
        self.gated_kernels = Kernels(_planned(_gated_chain), _gated_chain, _rows_at(1))
        self.attention_kernels = Kernels(_planned(_attention_chain), _attention_chain,
                                         _attention_rows)  # fmt: skip
        self.conv_kernels = Kernels(_compile_conv)

    def clear(self) -> None:
        """Forget every remembered call, bucket and kernel (calls are then only slower)."""
        for memo in (self.replays, self.by_keys, self.conv_replays, self.buckets):
            memo.reset()
        for kernels in (self.gemm_kernels, self.gated_kernels, self.attention_kernels,
                        self.conv_kernels):  # fmt: skip
            kernels.cache_clear()

    def info(self) -> dict[str, CacheInfo]:
        """Each cache by name: its size, bound, hits and misses since the last `clear()`."""
        found = {
            name: CacheInfo(len(memo), memo.limit, memo.hits, memo.misses)
            for name, memo in (("replays", self.replays), ("by_keys", self.by_keys),
                               ("conv_replays", self.conv_replays), ("buckets", self.buckets))
        }  # fmt: skip
        for name, kernels in (("gemm_kernels", self.gemm_kernels),
                              ("gated_kernels", self.gated_kernels),
                              ("attention_kernels", self.attention_kernels),
                              ("conv_kernels", self.conv_kernels)):  # fmt: skip
            held = kernels.cache_info()
            found[name] = CacheInfo(held.currsize, held.maxsize or 0, held.hits, held.misses)
        return found


#: the one call cache of `ops`
calls = CallCache()
