#!/bin/bash
# run.sh LABEL N [demo args...]: one boosted demo run (its own autogroup at nice -15) of the tree at $TREE (default:
# the current folder); summaries to $OUT (default runs/). $SITE: a folder holding a sitecustomize.py (this session
# used exp_sitecustomize.py, or diag_sitecustomize.py, renamed so), with $EXPENV its switches, e.g.
# EXPENV="EXP_PREFILL_NICE=19 EXP_SPLIT=1" ./run.sh sp 1 --decode-cpus 1 --prefill 1
label=$1; n=$2; shift 2
out=$(realpath -m "${OUT:-runs}"); mkdir -p "$out"
setsid bash -c "echo -15 > /proc/self/autogroup; cd ${TREE:-.}; env PYTHONPATH=${SITE:-} $EXPENV python -m mooncake_jax.cli demo --json $out/${label}_$n.json --trace $out/${label}_${n}_trace.json $* > $out/${label}_$n.out 2>&1"
python -c "
import json;d=json.load(open('$out/${label}_$n.json'));print('$label $n', *(f'{k}={d[k]}' for k in ['tbt_p99_over_step','tbt_p99_s','tbt_p90_s','decode_step_s','decode_batch_mean','ttft_p50_s','ttft_p99_s','slo_attainment']))"
