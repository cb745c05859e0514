"""A prefill instance's heartbeat names the requests its queue counts (``PrefillService.load``'s ``active``), so
the Conductor can add back the ones it sent there that have not arrived (``tests/test_conductor_queue_in_flight.py``
for the Conductor's side). Checked on a served in-process cluster: while a request runs on the engine loop, the load
names it with its prompt tokens and counts its predicted seconds; once its prefill is reported done, neither."""

import mooncake_jax as mj
from mooncake_jax.instance import prefill as prefill_module
from reference_model import random_prompts
from tiny_profile import PROFILE


def test_load_names_the_held_request_until_its_prefill_is_reported_done(monkeypatch):
    seen = []
    job = prefill_module.PrefillService._prefill_job

    def looking(self, *args, **kwargs):
        seen.append(self.load())  # on the engine loop: the request is queued and counted
        return job(self, *args, **kwargs)

    monkeypatch.setattr(prefill_module.PrefillService, "_prefill_job", looking)
    with mj.Cluster.local("tiny", prefill=1, decode=1, admission="none", warmup=False, compile_cache=None,
                          profile_json=PROFILE) as cluster:
        prompt = random_prompts([40], seed=3)[0]
        assert len(cluster.generate([prompt], max_new_tokens=2)[0]) == 2
        service = next(s for s in _services(cluster) if isinstance(s, prefill_module.PrefillService))
        after = service.load()
    assert len(seen) == 1
    (held,) = seen
    assert list(held["active"].values()) == [40] and held["queued_s"] > 0
    assert after["active"] == {} and after["queued_s"] == 0.0


def _services(cluster):
    for inst in cluster.instances.values():
        service = getattr(inst, "service", None)
        if service is not None:
            yield service
