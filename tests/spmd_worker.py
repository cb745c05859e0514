"""One process of a multi-process prefill instance, for tests/test_multiprocess.py (run as a script).

Every process joins the group and builds the instance's engine exactly as ``instance.main`` does
(``distributed.join_group``, ``server.build_engine``); process 0 then prefills the prompts given (logits of every
position) and decodes them greedily as one batch, writes the results to ``--out`` (npz) and stops the followers;
the others run ``distributed.run_follower``.
"""

import argparse
import json
import sys

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="InstanceConfig JSON (process_id included)")
    p.add_argument("--prompts", default="[]", help="JSON list of token lists (process 0)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--out", default="")
    a = p.parse_args()
    from mooncake_jax.instance.config import InstanceConfig
    from mooncake_jax.instance.devices import reserve_cpu_devices
    from mooncake_jax.instance.distributed import join_group, run_follower, stop_followers

    config = InstanceConfig.from_json(a.config)
    reserve_cpu_devices(config.device_count // config.num_processes)
    join_group(config.coordinator, config.num_processes, config.process_id, config.coordinator_timeout_s,
               config.collectives_host)
    if config.process_id != 0:
        return run_follower(config)

    import jax

    from mooncake_jax.llm import build_model
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.instance.server import build_engine

    model = build_model(config.model, seed=config.seed)
    engine = build_engine(config, model)
    out = {}
    seqs = []
    for i, prompt in enumerate(json.loads(a.prompts)):
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=a.new_tokens))
        engine.admit(seq)
        out[f"logits{i}"] = engine.prefill(seq, all_logits=True)
        seqs.append(seq)
    while seqs and not all(s.finished for s in seqs):
        engine.decode([s for s in seqs if not s.finished])
    for i, seq in enumerate(seqs):
        out[f"tokens{i}"] = np.array(seq.output, np.int32)
    out["global_devices"] = np.array(jax.device_count())
    out["local_devices"] = np.array(jax.local_device_count())
    np.savez(a.out, **out)
    stop_followers(engine.runner.channel)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
