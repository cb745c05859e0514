"""One instance over two processes (jax.distributed, gloo collectives on loopback): the same logits and greedy
tokens as one process, and the bad inputs of a process group (an id out of range, a group that never forms)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.instance.config import InstanceConfig
from reference_model import random_prompts, reference_for, reference_greedy

WORKER = Path(__file__).with_name("spmd_worker.py")
ROOT = Path(__file__).resolve().parents[1]
CHUNK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(process_id: int, port: int, stage: int, tensor: int, num_processes: int = 2, timeout_s: float = 90):
    return InstanceConfig(role="prefill", model="tiny", pipeline_stages=stage, tensor_parallel=tensor,
                          prefill_chunk_size=CHUNK, max_batch=4, coordinator=f"127.0.0.1:{port}",
                          num_processes=num_processes, process_id=process_id, coordinator_timeout_s=timeout_s)


def start(cfg: InstanceConfig, prompts, out: Path, new_tokens: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process: its own devices only
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(WORKER), "--config", cfg.to_json(), "--prompts", json.dumps(prompts),
                             "--new-tokens", str(new_tokens), "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_group(tmp_path, stage, tensor, prompts, new_tokens, meanwhile=lambda: None, timeout=240):
    """Run the 2-process instance on ``prompts``; ``meanwhile()`` runs here while the processes do. Returns (the
    processes' results, what ``meanwhile`` returned)."""
    port, out = free_port(), tmp_path / "out.npz"
    procs = [start(config(i, port, stage, tensor), prompts, out, new_tokens) for i in range(2)]
    try:
        expected = meanwhile()
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # nothing left behind, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return dict(np.load(out)), expected


def one_process(prompts, new_tokens, with_llm=True):
    """The float64 reference's logits and greedy tokens of ``prompts`` over the weights every process builds (the
    tiny preset, seed 0), and with ``with_llm`` ``mj.LLM``'s greedy tokens on this one process."""
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.llama import init_model

    ref = reference_for(init_model(get_config("tiny"), 0))
    llm_tokens = None
    if with_llm:
        llm_tokens = mj.LLM("tiny", prefill_chunk_size=CHUNK).generate(prompts, max_new_tokens=new_tokens)
    return [ref(p) for p in prompts], [reference_greedy(ref, p, new_tokens) for p in prompts], llm_tokens


def check_equal_to_one_process(got, expected, prompts, global_devices, local_devices):
    assert int(got["global_devices"]) == global_devices and int(got["local_devices"]) == local_devices
    logits, greedy, llm_tokens = expected
    for i in range(len(prompts)):
        assert np.max(np.abs(got[f"logits{i}"] - logits[i])) / np.max(np.abs(logits[i])) <= 1e-4
        assert got[f"tokens{i}"].tolist() == greedy[i]
        if llm_tokens is not None:
            assert got[f"tokens{i}"].tolist() == llm_tokens[i]


@pytest.mark.slow  # two JAX processes over gloo: ~30 s on 2 cores (suite budget)
def test_two_processes_of_one_device_equal_one_process(tmp_path):
    """The default, smaller variant: stage=2 over 2 processes x 1 CPU device, one 2-chunk prompt whose prefill
    samples the first token (one program to compile per process), against the float64 reference."""
    prompts = random_prompts([29], seed=5)
    got, expected = run_group(tmp_path, 2, 1, prompts, 1, lambda: one_process(prompts, 1, with_llm=False))
    check_equal_to_one_process(got, expected, prompts, 2, 1)


@pytest.mark.slow
def test_two_processes_of_one_device_decode_equal_one_process(tmp_path):
    """stage=2 over 2 processes x 1 CPU device: a 3-chunk prompt, then greedy decode through both stages."""
    prompts = random_prompts([37], seed=5)
    got, expected = run_group(tmp_path, 2, 1, prompts, 3, lambda: one_process(prompts, 3))
    check_equal_to_one_process(got, expected, prompts, 2, 1)


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_process(tmp_path):
    """The issue's shape: stage=2, tensor=4 over 2 processes x 4 CPU devices (tensor inside a process, the
    pipeline's ppermute across them), two prompts, batched greedy decode."""
    prompts = random_prompts([37, 6], seed=5)
    got, expected = run_group(tmp_path, 2, 4, prompts, 4, lambda: one_process(prompts, 4))
    check_equal_to_one_process(got, expected, prompts, 8, 4)


@pytest.mark.slow  # the default suite runs the role command's variant below (same join_group, ~15 s each)
def test_group_that_never_forms_exits_with_a_clear_error(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc = start(config(0, port, 2, 1, timeout_s=2), [], tmp_path / "none.npz", 1)  # process 1 never comes
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3
    assert f"coordinator 127.0.0.1:{port} did not form within 2 s" in err
    assert time.monotonic() - t0 < 50
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # nothing left listening on its port
        s.connect(("127.0.0.1", port))


@pytest.mark.parametrize("changes, message", [
    (dict(process_id=2), "process_id 2 is out of range for num_processes=2; allowed: 0 to 1"),
    (dict(process_id=-1), "out of range"),
    (dict(coordinator=""), "needs coordinator HOST:PORT"),
    (dict(coordinator="127.0.0.1:notaport"), "needs coordinator HOST:PORT"),
    (dict(tensor_parallel=3, pipeline_stages=1), "cannot be split evenly over 2 processes"),
    (dict(num_processes=0, process_id=0), "num_processes must be a positive integer"),
    (dict(coordinator_timeout_s=0), "coordinator_timeout_s must be a positive number"),
    (dict(layerwise=True), "layer-wise prefill .* is not available"),
    (dict(devices="0-1"), "devices 0-1 cannot be given"),
    (dict(coordinator="10.1.2.3:1234"), "would take its collectives on 127.0.0.1, a loopback address, but its "
                                              "coordinator 10.1.2.3:1234 is on another host"),
])
def test_bad_process_group_configs(changes, message):
    fields = config(0, 1234, 2, 1).to_dict() | changes
    with pytest.raises(ValueError, match=message):
        InstanceConfig.from_dict(fields)


def test_each_process_takes_its_collectives_on_the_address_it_is_reached_at():
    """gloo listens where the other hosts reach this process: its advertised host, else its listen host; a wildcard
    leaves it to the machine's hostname."""
    remote = dict(coordinator="10.1.2.3:1234")
    assert config(1, 1, 2, 1).collectives_host == "127.0.0.1"
    assert config(1, 1, 2, 1).replace(host="10.1.2.4", **remote).collectives_host == "10.1.2.4"
    assert config(0, 1, 2, 1).replace(host="0.0.0.0", advertise="10.1.2.3:7000", **remote).collectives_host \
        == "10.1.2.3"
    assert config(0, 1, 2, 1).replace(host="0.0.0.0", advertise="10.1.2.3", **remote).collectives_host == "10.1.2.3"
    assert config(1, 1, 2, 1).replace(host="0.0.0.0", **remote).collectives_host is None
    assert config(1, 1, 2, 1).replace(host="::", advertise="[fd00::2]:7000", **remote).collectives_host == "fd00::2"
    assert config(1, 1, 2, 1).replace(host="::", advertise="fd00::2", **remote).collectives_host == "fd00::2"


def test_process_group_fields_travel_in_the_one_serializer():
    cfg = config(1, 4321, 2, 4)
    again = InstanceConfig.from_json(cfg.to_json())
    assert (again.coordinator, again.num_processes, again.process_id) == ("127.0.0.1:4321", 2, 1)
    assert InstanceConfig(role="prefill").num_processes == 1  # one process unless asked


def test_instance_command_refuses_a_process_id_out_of_range(capsys):
    from mooncake_jax.instance.main import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--role", "prefill", "--conductor", "127.0.0.1:1", "--coordinator", "127.0.0.1:2",
                    "--num-processes", "2", "--process-id", "5", "--pipeline-stages", "2"])
    assert "process_id 5 is out of range for num_processes=2" in capsys.readouterr().err


def test_instance_command_takes_the_group_timeout(capsys):
    from mooncake_jax.instance.main import parse_args

    config = parse_args(["--role", "prefill", "--conductor", "127.0.0.1:1", "--coordinator", "127.0.0.1:2",
                         "--num-processes", "2", "--process-id", "1", "--pipeline-stages", "2",
                         "--coordinator-timeout-s", "7.5"])
    assert config.coordinator_timeout_s == 7.5
    with pytest.raises(SystemExit):
        parse_args(["--role", "prefill", "--conductor", "127.0.0.1:1", "--coordinator", "127.0.0.1:2",
                    "--num-processes", "2", "--process-id", "1", "--pipeline-stages", "2",
                    "--coordinator-timeout-s", "0"])
    assert "coordinator_timeout_s must be a positive number, got 0.0" in capsys.readouterr().err


def test_instance_command_refuses_a_shape_the_model_cannot_split_before_joining(capsys):
    """stage=3 cannot stack the tiny model's 4 layers into equal stages: refused before waiting for any process."""
    from mooncake_jax.instance.main import main

    assert main(["--role", "prefill", "--conductor", "127.0.0.1:1", "--coordinator", "127.0.0.1:2",
                 "--num-processes", "3", "--process-id", "0", "--pipeline-stages", "3"]) == 2
    assert "stage=3 does not divide tiny's 4 layers; allowed: [1, 2, 4]" in capsys.readouterr().err


def test_instance_command_follower_whose_group_never_forms_exits_clearly(tmp_path):
    """The role command a user types for process 1, with no process 0 anywhere: a stated timeout, status 3, a line
    naming the coordinator; nothing else was started (a follower neither listens nor registers)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mooncake_jax.cli", "instance", "--role", "prefill", "--conductor",
                           "127.0.0.1:1", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                           "--process-id", "1", "--pipeline-stages", "2", "--coordinator-timeout-s", "2"],
                          env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"process 1 of 2: the process group at coordinator 127.0.0.1:{port} did not form within 2 s" in proc.stderr
    assert proc.stdout == ""  # no ready line
    assert time.monotonic() - t0 < 60
