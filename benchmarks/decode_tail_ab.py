"""The whole decode step with and without decode attention's tail loop (``attention.DECODE_TAIL_PAGES``), two
engines in one process, steps interleaved (one of each in turn), so both see the same load.

The tail is read when the step is traced, so each engine is built and compiled with its own setting (and a page
count of its own, so the two do not share one compiled program). Reports wall (min, median) and process CPU time
(median) per step (``common.interleaved``).

    python benchmarks/decode_tail_ab.py --batch 32 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_ab_parser, interleaved, machine_info, swapped_decode_steps, write_json  # noqa: E402


def main() -> None:
    p = decode_ab_parser(__doc__)
    args = p.parse_args()

    from mooncake_jax.model import attention

    steps = swapped_decode_steps(args, attention, "DECODE_TAIL_PAGES",
                                 {"no_tail": 0, "tail": attention.DECODE_TAIL_PAGES})
    if steps["no_tail"][1] != steps["tail"][1]:
        raise SystemExit("the two forms sampled different first tokens")
    res = dict(machine_info(), model=args.model, batch=args.batch, context=args.context, steps=args.steps,
               **interleaved({name: run for name, (run, _) in steps.items()}, args.steps))
    res["wall_median_ratio"] = res["tail_wall_median_ratio"]
    res["wall_min_ratio"] = res["tail_wall_min_ratio"]
    res["cpu_median_ratio"] = res["tail_cpu_ratio"]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
