#!/bin/bash
# run.sh LABEL N [demo args...]: one boosted demo run of /work/main
label=$1; n=$2; shift 2
out=/work/scratch/s24/runs; mkdir -p $out
setsid bash -c "echo -15 > /proc/self/autogroup; cd ${TREE:-/work/main}; env PYTHONPATH=/work/scratch/s24/site $EXPENV python -m mooncake_jax.cli demo --json $out/${label}_$n.json --trace $out/${label}_${n}_trace.json $* > $out/${label}_$n.out 2>&1"
python -c "
import json;d=json.load(open('$out/${label}_$n.json'));print('$label $n', *(f'{k}={d[k]}' for k in ['tbt_p99_over_step','tbt_p99_s','tbt_p90_s','decode_step_s','decode_batch_mean','ttft_p50_s','ttft_p99_s','slo_attainment']))"
