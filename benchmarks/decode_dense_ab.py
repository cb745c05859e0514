"""The whole decode step with this tree's dense products on the decode copy (``llama.decode_product``: the weight
as the left-hand operand) against the plain form (``x @ w.T``, the weight as the right-hand operand, as before the
twentieth pass), two engines in one process, steps interleaved (one of each in turn), so both see the same load.

The first engine compiles its decode program with ``llama.STREAMED_ROWS_MAX`` at 0 (every product in the plain
form; the limit is read when the step is traced), so ``--batch`` must be at most the limit; each engine has a page count of its own, so the two do not share
one compiled program. Both engines' first sampled tokens must agree. Reports wall (min, p25, median) and process CPU
time (median) per step (``common.interleaved``), ``plain`` first.

    python benchmarks/decode_dense_ab.py --batch 32 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_ab_parser, interleaved, machine_info, swapped_decode_steps, write_json  # noqa: E402


def main() -> None:
    p = decode_ab_parser(__doc__)
    args = p.parse_args()

    from mooncake_jax.model import llama

    limit = llama.STREAMED_ROWS_MAX  # 0 rows streamed: every product in the plain form
    if args.batch > limit:
        raise SystemExit(f"--batch {args.batch}: above STREAMED_ROWS_MAX = {limit} both engines run the plain form")
    steps = swapped_decode_steps(args, llama, "STREAMED_ROWS_MAX", {"plain": 0, "tree": limit})
    if steps["plain"][1] != steps["tree"][1]:
        raise SystemExit("the two forms sampled different first tokens")
    b, ctx = args.batch, args.context
    res = dict(machine_info(), model=args.model, batch=b, context=ctx, steps=args.steps, streamed_rows_max=limit,
               **interleaved({name: run for name, (run, _) in steps.items()}, args.steps))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
