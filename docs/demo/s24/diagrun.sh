#!/bin/bash
# diagrun.sh LABEL N [demo args]: run.sh with hop stamps ($SITE: a folder holding diag_sitecustomize.py as
# sitecustomize.py, beside exp_sitecustomize.py and the s21 file it reads); logs into runs/LABEL_N_diag, then the
# twenty-first session's hops.py (docs/demo/s21_diag/hops.py) over them
rm -rf /tmp/diag21; label=$1; n=$2
"$(dirname "$0")/run.sh" "$@"
rm -rf runs/${label}_${n}_diag; mv /tmp/diag21 runs/${label}_${n}_diag
python "$(dirname "$0")/../s21_diag/hops.py" runs/${label}_${n}_trace.json runs/${label}_${n}_diag
