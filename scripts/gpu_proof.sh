#!/usr/bin/env bash
# Run on a GPU host (the lent H200 via the device tool): proves the cuda backend on real CUDA VMM.
#   1. the seed's engine-2 pool through the stock allocator hangs (GIL cycle), fixed starts;
#   2. two co-located simulated engines on one GPU (scenarios/two-engine-cuda.yaml): stock → exit 10
#      with gil_cycle on engine 2, fixed → exit 0;
#   3. (optional) kvcached 0.1.6 from its sdist (the first release with the C++ allocator, already
#      fixed by upstream PR #422) starts with the same engine-2 parameters.
# Logs go to ${OUT:-./gpu-out}; a summary table to summary.txt.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/runs"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee -a "$OUT/summary.txt"
log "build kvdiag"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/runs/build.log" 2>&1 || { log "build failed"; tail -30 "$OUT/runs/build.log"; exit 1; }
python3 -c "import kvdiag._native as n; print('native ok', n.__file__)" | tee -a "$OUT/summary.txt"

log "allocator: seed engine-2 pool on CUDA VMM"
for alloc in stock fixed; do
  s=$(date +%s.%N)
  timeout 25 python3 tests/fixtures/alloc_engine2.py --allocator $alloc --backend cuda --alarm-s 30 > "$OUT/runs/engine2-$alloc.log" 2>&1
  rc=$?; e=$(date +%s.%N)
  log "engine2 $alloc: rc=$rc ($(python3 -c "print(round($e-$s,2))") s) last: $(tail -1 "$OUT/runs/engine2-$alloc.log")"
done

log "co-located sim engines on one GPU (cuda backend)"
python3 -m kvdiag repro two-engine --scenario scenarios/two-engine-cuda.yaml --out "$OUT/runs/stock" > "$OUT/runs/repro-stock.txt" 2>&1
log "repro stock: exit $? verdict $(python3 -c "import json;r=json.load(open('$OUT/runs/stock/report.json'));print(r['verdict']['kind'], r['verdict'].get('engine'))" 2>&1)"
python3 -m kvdiag repro two-engine --scenario scenarios/two-engine-cuda.yaml --allocator fixed --out "$OUT/runs/fixed" > "$OUT/runs/repro-fixed.txt" 2>&1
log "repro fixed: exit $? verdict $(python3 -c "import json;r=json.load(open('$OUT/runs/fixed/report.json'));print(r['verdict']['kind'])" 2>&1)"
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/summary.txt"

if [ -f .kvc/kvcached-0.1.6.tar.gz ] && [ "${KVC:-1}" = 1 ]; then
  log "kvcached 0.1.6 (upstream, post-#422) build"
  mkdir -p /tmp/kvc && tar xzf .kvc/kvcached-0.1.6.tar.gz -C /tmp/kvc
  (cd /tmp/kvc/kvcached-0.1.6 && timeout 400 python3 -m pip install -q --no-build-isolation --no-deps . ) > "$OUT/runs/kvcached-build.log" 2>&1
  log "kvcached build rc=$?"
  timeout 60 python3 scripts/kvcached_engine2.py > "$OUT/runs/kvcached-engine2.log" 2>&1
  log "kvcached engine2: rc=$? last: $(tail -2 "$OUT/runs/kvcached-engine2.log" | tr '\n' ' ')"
fi
tar czf "$OUT/gpu-runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
log "done"
