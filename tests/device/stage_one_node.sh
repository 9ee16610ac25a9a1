#!/bin/sh
# One node's staging against the best copy by hand, on the lent machine (16 cores, nothing else running):
# the machine, the copy methods (bench/stage_copy_methods.py) and stage_bench's goal rows at 2 and 8 GiB.
#   sh tests/device/stage_one_node.sh        (results under $OUT)
export PYTHONPATH="$PWD/plugins/module_utils" PYTHONUNBUFFERED=1 LLMFLEET_BENCH_DIR=/var/tmp/llmfleet-bench
{
  date -u; nproc; free -g; df -T /var/tmp; uname -r; python3 --version; openssl version
  echo "dirty_ratio $(cat /proc/sys/vm/dirty_ratio) dirty_background_ratio $(cat /proc/sys/vm/dirty_background_ratio)"
  if sync && echo 3 >/proc/sys/vm/drop_caches; then echo "page cache can be dropped"; else echo "page cache NOT dropped"; fi
} >"$OUT/machine.txt" 2>&1
timeout 200 python3 bench/stage_bench.py --gb 2 --shards 8 --repeat 3 --goal-only --skip restage fleet \
  --out "$OUT/bench-2g.md" >"$OUT/bench-2g.log" 2>&1
timeout 100 python3 bench/stage_copy_methods.py "$LLMFLEET_BENCH_DIR/src-2g-8" "$LLMFLEET_BENCH_DIR/cm" 2 \
  >"$OUT/copy-methods-2g.txt" 2>&1
timeout 260 python3 bench/stage_bench.py --gb 8 --shards 8 --repeat 3 --goal-only --skip restage fleet \
  --out "$OUT/bench-8g.md" >"$OUT/bench-8g.log" 2>&1
date -u >>"$OUT/machine.txt"
