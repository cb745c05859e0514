"""The shared-token gate of both front ends, and the rule that keeps an open gateway off the network.

A gateway listening beyond loopback without a token would let anyone on the network generate (and fill the
cluster's KV), so ``check_exposure`` refuses that unless the caller says it is intended.
"""

from __future__ import annotations

from mooncake_jax.addresses import is_loopback


def check_exposure(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    if token is None and not is_loopback(host) and not allow_unauthenticated:
        raise ValueError(f"refusing to listen on {host!r} without an auth_token: anyone who can reach it could "
                         f"generate; give a token, listen on 127.0.0.1, or pass allow_unauthenticated=True")
    if token is not None and not token.strip():
        raise ValueError("auth_token must not be empty")


API_KEY_ENV = "MOONCAKE_API_KEY"
"""The environment variable a server reads its shared token from when neither a flag nor a file gives one (a
command-line token shows in ``ps`` to every user of the machine)."""


def resolve_token(flag: str | None, file: str | None, environ) -> str | None:
    """The shared token: from ``--auth-token``, else the first line of ``--auth-token-file``, else the
    ``MOONCAKE_API_KEY`` variable of ``environ``; None when none is given. At most one source may be given
    explicitly; an empty token is an error."""
    if flag is not None and file is not None:
        raise ValueError("give --auth-token or --auth-token-file, not both")
    if file is not None:
        try:
            with open(file, encoding="utf-8") as f:
                token = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the token file {file}: {e}") from None
        if not token:
            raise ValueError(f"the token file {file} is empty")
        return token
    if flag is not None:
        if not flag.strip():
            raise ValueError("--auth-token must not be empty")
        return flag
    token = environ.get(API_KEY_ENV, "").strip()
    return token or None
