"""The whole decode step with this tree's dense products on the decode copy (``llama.decode_product``: the weight
as the left-hand operand) against the plain form (``x @ w.T``, the weight as the right-hand operand, as before the
twentieth pass), two engines in one process, steps interleaved (one of each in turn), so both see the same load.

The plain form stands in for ``llama.decode_product`` while the first engine compiles its decode program (the
function is looked up when the step is traced); each engine has a page count of its own, so the two do not share
one compiled program. Both engines' first sampled tokens must agree. Reports wall (min, p25, median) and process CPU
time (median) per step (``common.interleaved``), ``plain`` first.

    python benchmarks/decode_dense_ab.py --batch 32 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_ab_parser, interleaved, machine_info, swapped_decode_steps, write_json  # noqa: E402


def plain_product(x, w, out_dtype=None):
    """``x @ w.T`` as written before the twentieth pass: YNNPACK packs (transposes) all of ``w`` every call."""
    import jax.numpy as jnp

    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=out_dtype or x.dtype)


def main() -> None:
    p = decode_ab_parser(__doc__)
    args = p.parse_args()

    from mooncake_jax.model import llama

    steps = swapped_decode_steps(args, llama, "decode_product", {"plain": plain_product, "tree": llama.decode_product})
    if steps["plain"][1] != steps["tree"][1]:
        raise SystemExit("the two forms sampled different first tokens")
    b, ctx = args.batch, args.context
    res = dict(machine_info(), model=args.model, batch=b, context=ctx, steps=args.steps,
               **interleaved({name: run for name, (run, _) in steps.items()}, args.steps))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
