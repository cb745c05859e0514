"""The Messenger receiver's own work in one process: storing received messages of whole records, per record against
per message, CPU seconds per GB of block data.

A Messenger receiver gets messages of several 16-token blocks of the ``small`` preset (five to a message) or one
128-token block each. Per record, as before issue 15's eighth pass: each message parsed piece by piece
(``parse_message``, ``RecordAssembler.add``) and each record stored by its own pool call (``put_record``). Per
message, as the Messenger does now: the records read by their prefixes (``RecordAssembler.records``) and stored by one
pool call (``put_records``). Both store into a DRAM pool at capacity (every record evicts one, as at a serving
receiver), alternated round by round over the same messages, CPU time of this process (which the load of a shared
machine moves less than wall time). The copy and hash of each record, the same either way, are in both figures: the
difference is Python per record. Flat JSON: ``per_record_cpu_s_per_gb_{16,128}``, ``per_message_cpu_s_per_gb_{16,128}``
and their ratios ``receive_cpu_ratio_{16,128}`` (per message over per record), with the CPU model and load average.
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import arg_parser, cpu_model, write_json
from benchmarks.pool import make_blocks, small_spec
from mooncake_jax.transfer.pieces import RecordAssembler, next_separator, parse_message, records_per_message
from mooncake_jax.transfer.pool import BlockPool


def measure(block_tokens: int, n_blocks: int, rounds: int) -> dict[str, float]:
    spec = small_spec(block_tokens)
    blocks = make_blocks(spec, 16)
    source = BlockPool(spec, dram_blocks=2 * n_blocks)
    source.put_many(list(range(2 * n_blocks)), [blocks[i % len(blocks)] for i in range(2 * n_blocks)])
    per = records_per_message(source.frame_bytes)
    separator = next_separator(source.record_bytes)
    # each message a fresh copy, as gRPC delivers one (the source's own message would be shared with the sink)
    batches = [[memoryview(source.join_records(list(range(first + i, min(first + i + per, first + n_blocks))),
                                               separator)[0]).tobytes()
                for i in range(0, n_blocks, per)] for first in (0, n_blocks)]  # two key sets: each round evicts
    sink = BlockPool(spec, dram_blocks=n_blocks)

    def per_record(messages: list[bytes]) -> None:
        assembler = RecordAssembler(spec)
        for message in messages:
            for piece, raw in parse_message(message):
                record = assembler.add(piece, raw)
                if record is not None:
                    sink.put_record(piece.key, record)

    def per_message(messages: list[bytes]) -> None:
        assembler = RecordAssembler(spec)
        new: list[bool] = []
        for message in messages:
            sink.put_records(assembler.records(message), new)

    trials = {"per_record": per_record, "per_message": per_message}
    cpu: dict[str, list[float]] = {name: [] for name in trials}
    gb = n_blocks * source.frame_bytes / 1e9
    turn = 0
    for warm in (True, True, *([False] * rounds)):
        for name, store in trials.items():
            started = time.process_time()
            store(batches[turn % 2])
            turn += 1
            if not warm:
                cpu[name].append((time.process_time() - started) / gb)
    assert len(sink) == n_blocks
    figures = {f"{name}_cpu_s_per_gb_{block_tokens}": round(statistics.median(values), 4)
               for name, values in cpu.items()}
    figures[f"receive_cpu_ratio_{block_tokens}"] = round(
        figures[f"per_message_cpu_s_per_gb_{block_tokens}"] / figures[f"per_record_cpu_s_per_gb_{block_tokens}"], 3)
    figures[f"records_per_message_{block_tokens}"] = per
    return figures


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    results: dict = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    results.update(measure(16, 400, args.rounds))
    results.update(measure(128, 64, args.rounds))
    results["load_average_end"] = os.getloadavg()[0]
    write_json(results, args.json)


if __name__ == "__main__":
    main()
