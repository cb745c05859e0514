#!/bin/bash
# diagrun.sh LABEL N [demo args]: a run with hop stamps; logs into runs/LABEL_N_diag
rm -rf /tmp/diag21; label=$1; n=$2
sed -i 's#site[0-9]*#site2#' run.sh
./run.sh "$@"
sed -i 's#site2#site#' run.sh
rm -rf runs/${label}_${n}_diag; mv /tmp/diag21 runs/${label}_${n}_diag
python hops.py runs/${label}_${n}_trace.json runs/${label}_${n}_diag
