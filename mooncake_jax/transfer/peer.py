"""A Messenger serving its own pool as a separate process: ``python -m mooncake_jax.transfer.peer``.

Instances embed ``MessengerServer`` directly; this entry point exists for what needs a peer in another process:
the two-process tests and the transfer benchmark (through ``PeerProcess``), and serving an SSD pool directory
left by a stopped instance. It prints ``LISTENING host:port`` once it accepts calls, and stops on SIGTERM/SIGINT
or, with ``--stop-on-eof``, when its standard input closes (so it cannot outlive the process that started it).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mooncake_jax.transfer.messenger import MessengerServer
from mooncake_jax.transfer.pool import BlockPool
from mooncake_jax.transfer.spec import BlockSpec
from mooncake_jax.transfer.tiers import SPEC_FILE


def _spec_from_args(args: argparse.Namespace) -> BlockSpec:
    if args.shape:
        try:
            return BlockSpec([int(d) for d in args.shape.split(",")], args.dtype)
        except ValueError as err:
            raise ValueError(f"--shape {args.shape!r}: {err}") from err
    if args.ssd:
        try:
            with open(f"{args.ssd}/{SPEC_FILE}") as spec_file:
                return BlockSpec.from_json(spec_file.read())
        except FileNotFoundError:
            pass
    raise SystemExit("give --shape (and --dtype), or --ssd naming an existing pool directory")


class PeerProcess:
    """A peer started as a child process with ``--stop-on-eof``; ``stop()`` (or leaving ``with``) ends it,
    killing it if it does not stop within ``grace_s``. ``address`` is where it listens."""

    def __init__(
        self, spec: BlockSpec, *, port: int = 0, dram_blocks: int | None = None, ssd: str | Path | None = None
    ) -> None:
        shape = ",".join(map(str, spec.shape))
        command = [sys.executable, "-m", "mooncake_jax.transfer.peer", "--shape", shape, "--dtype", spec.dtype.name,
                   "--port", str(port), "--stop-on-eof"]  # fmt: skip
        command += ["--dram-blocks", str(dram_blocks)] if dram_blocks is not None else []
        command += ["--ssd", str(ssd)] if ssd is not None else []
        package_parent = Path(__file__).resolve().parents[2]  # importable from there, installed or not
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=package_parent
        )
        line = self.process.stdout.readline()
        if not line.startswith("LISTENING "):
            self.stop()
            raise RuntimeError(f"peer process did not start (exit code {self.process.returncode}): {line!r}")
        self.address = line.split()[1]

    def stop(self, grace_s: float = 10.0) -> int:
        """Stop the process (it may already be gone); its exit code."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="block shape, comma-separated (default: read from the --ssd directory)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dram-blocks", type=int, default=None, help="DRAM capacity in blocks (default unbounded)")
    parser.add_argument("--ssd", help="SSD tier directory (created or reopened)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stop-on-eof", action="store_true", help="stop when standard input closes")
    args = parser.parse_args(argv)
    try:
        pool = BlockPool(_spec_from_args(args), dram_blocks=args.dram_blocks, ssd_path=args.ssd)
        server = MessengerServer(pool, host=args.host, port=args.port).start()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.stop_on_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(f"LISTENING {server.address}", flush=True)
    stop.wait()
    server.stop(grace_s=0.5)
    pool.close()


if __name__ == "__main__":
    main()
