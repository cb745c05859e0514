#!/bin/bash
# perfrun.sh LABEL N [demo args]: diagrun with perf sched events recorded (CLOCK_MONOTONIC)
label=$1; n=$2
perf record -q -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_waking -a -o /tmp/perf_$label.data > /dev/null 2>&1 &
pp=$!
sleep 1
"$(dirname "$0")/diagrun.sh" "$@"
kill -INT $pp; wait $pp
perf script -i /tmp/perf_$label.data -F pid,tid,cpu,time,event,trace > runs/${label}_${n}_sched.txt 2>/dev/null
ls -la runs/${label}_${n}_sched.txt
