#!/usr/bin/env bash
# How benchmarks/results/allocator-gpu-colocated-*.log were produced (kvdiag issue 5), on one NVIDIA H200:
# the working tree plus nanobind sources under build-gpu/nanobind, run from the repo root with $OUT set.
# It builds kvdiag._native with cmake against the machine's Python, starts engine 1 (fixed,
# backend=cuda) and then engine 2 four ways (stock/fixed x prealloc on/off) on the same GPU.
set -u
PY=/opt/torch/.venv/bin/python3
export PYTHONPATH=$PWD/build-gpu:$PWD
S=$OUT/summary.txt
{ nvidia-smi -L; $PY --version; } > $S 2>&1
if ! { cmake -S . -B /tmp/b -DKVDIAG_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DCMAKE_BUILD_TYPE=RelWithDebInfo \
       && cmake --build /tmp/b -j16; } > /tmp/build.log 2>&1; then
  echo "BUILD FAILED"; tail -30 /tmp/build.log; tail -30 /tmp/build.log >> $S; exit 1
fi
cp /tmp/b/_native*.so kvdiag/
$PY -c "import kvdiag._native as n; print('native', n.__file__)" >> $S 2>&1
DEV=h200-gpu0
$PY tests/fixtures/alloc_engine1.py --allocator fixed --backend cuda --device-name $DEV --duration-s 150 \
   > $OUT/engine1.log 2>&1 &
E1=$!
for i in $(seq 1 120); do grep -q "KVDIAG_E1 READY" $OUT/engine1.log && break; sleep 0.5; done
echo "engine1: $(grep -m1 'Init C++' $OUT/engine1.log)" >> $S
echo "engine1: $(grep -m1 'READY' $OUT/engine1.log)" >> $S
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | sed 's/^/gpu memory with engine1: /' >> $S
run() {  # allocator prealloc
  local log=$OUT/engine2-$1-prealloc-$2.log
  $PY tests/fixtures/alloc_engine2.py --allocator $1 --prealloc $2 --backend cuda --callback-maps cuda \
     --device-name $DEV --alarm-s 60 > $log 2>&1 &
  local P=$!
  local t0=$(date +%s.%N)
  for i in $(seq 1 100); do grep -q "KVDIAG_E2 STARTED" $log && break; kill -0 $P 2>/dev/null || break; sleep 0.1; done
  if grep -q "KVDIAG_E2 STARTED" $log; then
    echo "engine2 $1 prealloc=$2: STARTED ($(grep STARTED $log))" >> $S
    wait $P
  else
    echo "engine2 $1 prealloc=$2: HUNG (no STARTED 10 s after launch; last line: $(tail -1 $log))" >> $S
    { echo "== /proc evidence for pid $P"; cat /proc/$P/status | grep -E "State|Threads";
      for t in /proc/$P/task/*; do echo "task ${t##*/}: wchan=$(cat $t/wchan) syscall=$(cut -d' ' -f1-2 $t/syscall) stat=$(cut -d' ' -f3 $t/stat)"; done
    } >> $log 2>&1
    tail -8 $log >> $S
    kill -9 $P; wait $P 2>/dev/null
  fi
}
run stock on
run fixed on
run stock off
run fixed off
grep "KVDIAG_E1 STATS" $OUT/engine1.log | tail -1 | cut -c1-300 >> $S
kill $E1; wait $E1
echo "engine1 exit after SIGTERM: $?" >> $S
cat $S
