"""``mooncake-jax chat``: an interactive conversation with the local engine (no cluster).

Each line read from standard input is a user turn; the reply is rendered through the model's chat template
(``mj.LLM.stream_chat``) and printed piece by piece as its tokens are sampled, then kept in the conversation, so
the next turn sees the whole history. ``/reset`` forgets the history, ``/exit`` (or end of input) quits. Input may
be piped (``printf 'hi\\nmore\\n' | mooncake-jax chat``): the ``>>>`` prompt is shown only on a terminal.
"""

from __future__ import annotations

import sys

COMMANDS = {"/exit": "quit", "/quit": "quit", "/reset": "forget the conversation so far"}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or local Hugging Face folder")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the model folder's own; a preset has none)")
    p.add_argument("--system", default=None, help="a system message put before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])


def run(args, stdin=None, stdout=None) -> int:
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    from ..llm import LLM

    from ..gateway.chat import load_chat_template

    try:  # refused before the first turn: a folder without a usable tokenizer, no chat template
        llm = LLM(args.model, dtype=args.dtype)
        if load_chat_template(llm.tokenizer, args.chat_template) is None:
            raise ValueError(f"{args.model} has no chat template (no chat_template in tokenizer_config.json, no "
                             "chat_template.jinja): pass --chat-template FILE")
    except ValueError as e:
        print(f"mooncake-jax chat: {e}", file=sys.stderr)
        return 2
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    repetition_penalty=args.repetition_penalty)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = stdin.isatty()
    if interactive:
        print(f"chatting with {args.model}; " + ", ".join(f"{c}: {what}" for c, what in COMMANDS.items()),
              file=stdout, flush=True)
    while True:
        if interactive:
            print(">>> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            break
        turn = line.rstrip("\n")
        if not turn.strip():
            continue
        if COMMANDS.get(turn.strip()) == "quit":
            break
        if turn.strip() == "/reset":
            history.clear()
            continue
        messages = system + history + [{"role": "user", "content": turn}]
        pieces = []
        try:
            for piece in llm.stream_chat(messages, max_new_tokens=args.max_new_tokens,
                                         chat_template=args.chat_template, **sampling):
                pieces.append(piece)
                print(piece, end="", file=stdout, flush=True)
        except ValueError as e:  # the template refuses the conversation, a bad sampling value: this turn only
            print(f"mooncake-jax chat: {e}", file=sys.stderr)
            if not pieces:
                continue  # the turn is dropped; the conversation goes on
        print(file=stdout, flush=True)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": "".join(pieces)}]
    return 0
