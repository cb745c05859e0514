#!/bin/bash
# usage: ab2.sh tag rounds "name|EXP_MODE|demo args" ...
tag=$1; rounds=$2; shift 2
cd /tmp/s20
for r in $(seq $rounds); do
 for v in "$@"; do
  IFS='|' read name em args <<< "$v"
  out=ab_${tag}_${name}_$r
  l0=$(cut -d' ' -f1 /proc/loadavg)
  setsid bash -c "echo -15 > /proc/self/autogroup; EXP_MODE=$em PYTHONPATH=${PP:-/work/main}:/work/scratch/s20/exp exec mooncake-jax demo $args --json $out.json --trace $out.trace.json" > $out.log 2>&1
  python /work/scratch/s20/abstat.py $out.json $out.trace.json "$name $r load $l0" >> ab_${tag}.txt || tail -3 $out.log >> ab_${tag}.txt
 done
done
