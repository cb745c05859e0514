"""The whole decode step with this tree's xla decode attention against the one of another version of
``attention.py`` (a file: ``git show BASE:mooncake_jax/model/attention.py > /tmp/base_attention.py``), two engines in
one process, steps interleaved (one of each in turn), so both see the same load.

The other file's ``_decode_xla`` stands in for this tree's while the first engine compiles its decode program (the
function is looked up when the step is traced); each engine has a page count of its own, so the two do not share
one compiled program. Everything else (the model, the dense products, sampling, the host side) is this tree's.
Reports wall (min, p25, median) and process CPU time (median) per step (``common.interleaved``), ``base`` first.

    python benchmarks/decode_step_ab.py --base /tmp/base_attention.py --batch 32 --json out.json
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_ab_parser, interleaved, machine_info, swapped_decode_steps, write_json  # noqa: E402


def load_decode(path: Path):
    """``_decode_xla`` of the attention module at ``path``, imported as a module of the package (its relative
    imports resolve against this tree's ``mooncake_jax.model``)."""
    if not path.is_file():
        raise SystemExit(f"--base {path}: no such file")
    spec = importlib.util.spec_from_file_location("mooncake_jax.model._base_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "_decode_xla"):
        raise SystemExit(f"--base {path} has no _decode_xla")
    return module._decode_xla


def main() -> None:
    p = decode_ab_parser(__doc__)
    p.add_argument("--base", type=Path, required=True, help="the attention.py to compare against")
    args = p.parse_args()

    from mooncake_jax.model import attention

    steps = swapped_decode_steps(args, attention, "_decode_xla",
                                 {"base": load_decode(args.base), "tree": attention._decode_xla})
    if steps["base"][1] != steps["tree"][1]:
        raise SystemExit("the two attentions sampled different first tokens")
    b, ctx = args.batch, args.context
    res = dict(machine_info(), model=args.model, batch=b, context=ctx, steps=args.steps, base=str(args.base),
               **interleaved({name: run for name, (run, _) in steps.items()}, args.steps))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
