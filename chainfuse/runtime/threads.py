"""The thread count of kernel calls: an explicit override, a front end's count, the default.

Generated kernels take the count as an argument (``num_threads(nt)`` clauses), so no OpenMP
runtime call is needed and two calls may use different counts. State kept on purpose and small:
the `set_num_threads` override, a front end's count per context (`call_threads`), and whether a
kernel or another library may have had threads running when this process was forked (then it runs
on one).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Iterator

from chainfuse import config

__all__ = [
    "call_threads",
    "get_num_threads",
    "num_threads",
    "requested_num_threads",
    "reset_call_threads",
    "set_num_threads",
    "threads_for",
]

_num_threads: int | None = None
# a front end's thread count for the calls it makes (`call_threads`): chainfuse.torch's, torch's
_call_threads: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "chainfuse_call_threads", default=None
)
_threads_ran = False  # a kernel call was given more than one thread (OpenMP workers may exist)
_threads_at_fork = 1  # OS threads of this process when it last forked (`_before_fork`)
_forked = False  # this process was forked after either (`_after_fork_in_child`)
_fork_warned = False


def _before_fork() -> None:
    """Count the parent's threads: any OpenMP team (PyTorch's runs on the same libgomp as our
    kernels) or other thread alive at the fork is gone in the child."""
    global _threads_at_fork
    try:
        _threads_at_fork = len(os.listdir("/proc/self/task"))
    except OSError:  # (no /proc: the threads Python knows of, and our own kernels' below)
        _threads_at_fork = threading.active_count()


def _after_fork_in_child() -> None:
    global _forked, _fork_warned
    _forked = _forked or _threads_ran or _threads_at_fork > 1
    _fork_warned = False


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def set_num_threads(n: int | None) -> None:
    """Threads for kernels launched from now on; ``None`` returns to the default."""
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"number of threads must be a positive int or None, not {n!r}")
    _num_threads = n


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """`set_num_threads(n)` for the block, then the count set before it back (a benchmark that
    times kernels planned for `n` threads, whatever its caller set)."""
    before = requested_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(before)


def requested_num_threads() -> int | None:
    """The count `set_num_threads` set (None: none, the default applies); what a caller that
    changes the count for a while puts back afterwards."""
    return _num_threads


def get_num_threads() -> int:
    """Threads a kernel call should use: the `set_num_threads` value, else the config default.

    Generated kernels take this as an argument and pass it to ``num_threads(nt)`` clauses, so no
    OpenMP runtime call is needed and two calls may use different counts. Inside a front end's
    `call_threads` (chainfuse.torch's functions: ``torch.get_num_threads()``) its count comes
    before the default, after an explicit `set_num_threads`.

    In a process forked while its parent had other threads (after a kernel or another library,
    e.g. PyTorch, ran OpenMP workers; a ``fork`` start method's worker, a PyTorch DataLoader's)
    it is 1, with a RuntimeWarning the first time: GNU OpenMP's workers do not survive a fork,
    and the child's next parallel region would wait for them forever (PyTorch runs such a
    child's own ops on one thread too). Start the workers with ``spawn`` or
    ``forkserver`` to give them threads.
    """
    return threads_for(_call_threads.get())


def threads_for(call: int | None) -> int:
    """`get_num_threads` for a call made with a front end's count `call` (None: none), without
    a `call_threads` context: chainfuse.torch's calls that replay a known one pass
    ``torch.get_num_threads()`` here, cheaper than entering and leaving the context."""
    global _threads_ran
    n = _num_threads
    if n is None:
        n = call or config.default_num_threads()
    if n > 1:
        if _forked:
            _warn_forked(n)
            return 1
        _threads_ran = True
    return n


def call_threads(n: int) -> contextvars.Token[int | None]:
    """Make `get_num_threads` answer `n` (unless `set_num_threads` set a count) in this context
    until ``reset_call_threads(token)``: a front end's calls follow its library's setting."""
    return _call_threads.set(n)


def reset_call_threads(token: contextvars.Token[int | None]) -> None:
    """Undo the `call_threads` that returned `token`."""
    _call_threads.reset(token)


def _warn_forked(n: int) -> None:
    global _fork_warned
    if not _fork_warned:
        _fork_warned = True
        warnings.warn(
            f"chainfuse: this process was forked while its parent ran other threads (OpenMP "
            f"workers of chainfuse's kernels or of another library, e.g. PyTorch); they do not "
            f"survive a fork (GNU OpenMP would hang), so its kernels "
            f"run on 1 thread, not {n} (start worker processes with 'spawn' or 'forkserver' to "
            "give them threads)",
            RuntimeWarning,
            stacklevel=4,  # (the caller of ops.* or of a kernel)
        )
