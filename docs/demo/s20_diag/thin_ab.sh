#!/bin/bash
tag=$1; rounds=$2
cd /tmp/s20
for r in $(seq $rounds); do
 for m in thin base; do
  out=ab_${tag}_${m}_$r
  port=$(python -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  tp=$port; [ $m = base ] && tp=0
  l0=$(cut -d' ' -f1 /proc/loadavg)
  setsid bash -c "echo -15 > /proc/self/autogroup; THIN_PORT=$tp PYTHONPATH=/work/main:/work/scratch/s20/thin exec mooncake-jax demo --json $out.json --trace $out.trace.json" > $out.log 2>&1
  python /work/scratch/s20/abstat.py $out.json $out.trace.json "$m $r load $l0" >> ab_${tag}.txt || tail -3 $out.log >> ab_${tag}.txt
 done
done
