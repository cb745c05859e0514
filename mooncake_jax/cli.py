"""The ``mooncake-jax`` command.

Each subcommand lives in the module that owns its job; this file only names them, so ``mooncake-jax --help`` is
fast and imports nothing heavy. A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mooncake_jax.demo", "run the main job end to end on the embedded default and print a results table"),
    "serve": ("mooncake_jax.instance.serve", "start a local cluster: Conductor, prefill and decode instances, gateway"),
    "simulate": ("mooncake_jax.sim.cli", "replay a request trace through the simulated cluster"),
    "profile": ("mooncake_jax.conductor.profile", "measure the local engine and write a cost-model profile JSON"),
    "generate": ("mooncake_jax.model.cli", "generate tokens with the local engine (no cluster)"),
    "chat": ("mooncake_jax.model.chat_cli", "chat with the local engine through the model's chat template"),
    "conductor": ("mooncake_jax.conductor.command", "run the Conductor alone (instances and gateways join it)"),
    "instance": ("mooncake_jax.instance.main", "run one prefill or decode instance that joins a Conductor"),
    "gateway": ("mooncake_jax.gateway.command", "run the gRPC + HTTP gateway of a Conductor's cluster"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if not a.startswith("-")), None)
    if selected not in SUBCOMMANDS:
        selected = None
    args = build_parser(selected).parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    _start_with_default_slices()
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


def _start_with_default_slices() -> None:
    """Every command starts with the default CPU slice: one started by a process that asked for short ones (a
    Conductor restarted by ``serve`` once it serves) inherited them; those that carry tokens ask again once they
    serve (``instance/main.settle_serving_process``)."""
    from .instance import sched_slice

    if sched_slice.slice_ns() == sched_slice.SHORT_SLICE_NS:
        sched_slice.restore_default_slices()


if __name__ == "__main__":
    sys.exit(main())
