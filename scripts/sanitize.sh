#!/usr/bin/env bash
# Builds the Python-free stress driver (csrc/stress_main.cpp + the allocator core) under
# ThreadSanitizer and AddressSanitizer (+UBSan) in separate build dirs, runs multi-threaded
# alloc/free/trigger/resize/trim stress on the FIXED allocator (host backend), and exits non-zero
# on any sanitizer report, libstdc++ assertion (-D_GLIBCXX_ASSERTIONS) or inconsistent final
# state (the concurrent paths: combined synchronous maps, in-flight waits, worker wake-ups).
# ~2-3 min on 2 cores.
#
#   scripts/sanitize.sh            # both
#   scripts/sanitize.sh tsan|asan  # one
set -euo pipefail
cd "$(dirname "$0")/.."

CXX=${CXX:-g++}
SRCS="csrc/common.cpp csrc/device.cpp csrc/backend_host.cpp csrc/backend_cuda.cpp csrc/stock_allocator.cpp
      csrc/fixed_allocator.cpp csrc/stress.cpp csrc/stress_main.cpp"
WHICH=${1:-all}
status=0

build() {  # dir flags...
  local dir=$1; shift
  mkdir -p "$dir"
  echo "== building $dir/kvdiag_stress ($*)"
  # shellcheck disable=SC2086
  $CXX -std=c++17 -O1 -g -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS -Icsrc "$@" $SRCS -o "$dir/kvdiag_stress" -ldl -lpthread
}

run() {  # dir env-assignment args...
  local dir=$1 envset=$2; shift 2
  local log
  log="$dir/stress-$(echo "$*" | tr ' ' '_').log"
  echo "== $dir: kvdiag_stress $*"
  # The run is bounded by its op budget; timeout is the outer guard against a sanitizer hang.
  if ! env $envset timeout 150 "$dir/kvdiag_stress" "$@" >"$log" 2>&1; then
    echo "!! FAILED (exit $?): see $log"; tail -40 "$log"; status=1; return
  fi
  if grep -qE "WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:|LeakSanitizer" "$log"; then
    echo "!! sanitizer report in $log"; grep -m5 -E "WARNING|ERROR|runtime error" "$log"; status=1; return
  fi
  head -2 "$log"
}

if [[ $WHICH == all || $WHICH == tsan ]]; then
  build build-tsan -fsanitize=thread
  TS="TSAN_OPTIONS=halt_on_error=1:exitcode=66:second_deadlock_stack=1"
  run build-tsan "$TS" fixed 4 400000 random 0
  run build-tsan "$TS" fixed 10 200000 random 0      # over-subscribed pool: waits, out-of-pages
  run build-tsan "$TS" fixed 8 200000 alloc_free 0
  run build-tsan "$TS" fixed 4 20000 random 200      # slow maps: in-flight windows
  run build-tsan "$TS" fixed 10 20000 random 200     # slow maps, over-subscribed: combined maps, waits
fi
if [[ $WHICH == all || $WHICH == asan ]]; then
  build build-asan -fsanitize=address,undefined -fno-sanitize-recover=undefined
  AS="ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:exitcode=66 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1"
  run build-asan "$AS" fixed 4 1000000 random 0
  run build-asan "$AS" fixed 10 400000 random 0
  run build-asan "$AS" fixed 8 400000 alloc_free 0
  run build-asan "$AS" fixed 4 20000 random 200
  run build-asan "$AS" fixed 10 20000 random 200
fi
if [[ $status -eq 0 ]]; then echo "sanitize: clean"; else echo "sanitize: FAILED"; fi
exit $status
