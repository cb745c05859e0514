"""A Hugging Face folder served end to end (issue 14's first hour): a context window of 1,024 positions (too short
for the calibration's default decode grid) and an EOS the model samples at every step (the calibration used to
stop there with "sequence N is finished")."""

from __future__ import annotations

import json

import pytest

import mooncake_jax as mj
from mooncake_jax.instance.calibrate import decode_grid
from mooncake_jax.instance.cluster import Cluster

from test_weights import HF_CONFIG, random_hf_tensors, write_checkpoint


def test_decode_grid_fits_any_context_window():
    for limit, max_batch in ((1024, 32), (512, 32), (100, 1), (4096, 32)):
        grid = decode_grid(limit, max_batch)
        assert len(grid) >= 3, (limit, grid)
        assert all(b <= max_batch and b * (c + 8) <= limit for b, c in grid)
        assert len({b * c for b, c in grid}) >= 2  # the fit needs more than one context size


@pytest.mark.slow  # two start-up calibrations: about a minute on 2 quiet cores
def test_a_short_context_folder_whose_model_always_samples_eos_serves(tmp_path):
    cfg = {**HF_CONFIG, "max_position_embeddings": 1024, "eos_token_id": 0, "rope_scaling": None}
    tensors = random_hf_tensors(cfg)
    tensors["model.norm.weight"][:] = 0.0  # every logit 0: greedy picks token 0, the EOS, at every step
    folder = tmp_path / "hf"
    write_checkpoint(folder, cfg, tensors)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    expected = mj.LLM(str(folder)).generate([[5, 6, 7, 8]], max_new_tokens=4)
    with Cluster.local(str(folder), prefill=1, decode=1, warmup=False) as cluster:  # calibrates on start
        assert cluster.generate([[5, 6, 7, 8]], max_new_tokens=4) == expected == [[0]]
