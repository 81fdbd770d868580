#!/usr/bin/env bash
# The numerics tests' awkward sizes, tails, views and broadcasts, with every generated kernel built
# under AddressSanitizer and UndefinedBehaviorSanitizer (CHAINFUSE_SANITIZE): an out-of-bounds
# access or undefined behaviour in the generated C aborts the run. Arguments replace the slice.
#
#   bash scripts/sanitize.sh                      # the CI slice
#   bash scripts/sanitize.sh tests/numerics/test_conv_chain.py -k tail
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -x "$root/.venv/bin/python" && -z "${VIRTUAL_ENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$root/.venv/bin/activate"
fi
cc="${CC:-gcc}"
runtimes=()
for lib in libasan.so libubsan.so; do
    path="$($cc -print-file-name="$lib")"
    if [[ "$path" != /* || ! -e "$path" ]]; then
        echo "sanitize: $cc has no $lib (install gcc's sanitizer runtimes, e.g. libasan8 libubsan1)" >&2
        exit 1
    fi
    runtimes+=("$path")
done
if (($# == 0)); then
    # drawn sizes (1, primes, tails of every tile), strided and broadcast views, forced conv tiles
    # with tails and both halo policies, on 1 to 3 threads; the emulated AMX kernels' causal
    # key skipping and conv bands on threads, and their reads of weights packed once (about 2
    # minutes on 2 cores)
    set -- tests/numerics/test_gemm_chain.py tests/numerics/test_conv_chain.py \
        tests/numerics/test_amx_attention.py tests/numerics/test_amx_conv.py \
        tests/numerics/test_amx_model_features.py tests/numerics/test_kv_apart.py \
        tests/numerics/test_masked_blocks.py -k \
        "unmasked or few_rows or strided or op2_into_e or broadcast or fewer_blocks \
or zero_size or forced_tiles_and_halo or amx_causal_attention_of_unequal or amx_conv_bands \
or packed_once or a_copy_of_k_and_v or numpy_views or each_head_checks or per_batch_item"
fi
cache="$(mktemp -d "${TMPDIR:-/tmp}/chainfuse-sanitize-XXXXXX")"
trap 'rm -rf "$cache"' EXIT
# the ASan runtime must be loaded first, before Python's own allocations; leaks are Python's
export LD_PRELOAD="${runtimes[0]}:${runtimes[1]}${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export CHAINFUSE_SANITIZE=address,undefined
export CHAINFUSE_TEST_CACHE_DIR="$cache"
python -m pytest -q -p no:cacheprovider "$@"
