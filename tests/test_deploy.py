"""The deployment (deploy/): the Kubernetes manifests parse, run exactly the role commands with flags that exist
(parsed by the CLI's own argparse), probe the port each command listens on, and the Services reach those ports;
the Dockerfile's entry point is the command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mooncake_jax import cli

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ROLES = {"conductor", "instance", "gateway"}
POD_VALUES = {"POD_NAME": "mooncake-prefill-0", "POD_IP": "10.0.0.1"}  # what Kubernetes puts in $(NAME)


def manifests() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def containers(docs):
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def listen_ports(args) -> set[int]:
    """The ports a role command serves on (its gRPC ones first: what the probes must ask)."""
    ports = set()
    if args.command in ("conductor", "instance"):
        ports.add(int((args.listen or "").rpartition(":")[2]))
    if args.command == "gateway":
        ports |= {args.grpc_port, args.http_port}
    return ports


def test_every_manifest_runs_a_role_command_whose_flags_exist():
    docs = manifests()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Deployment", "Secret", "Service", "Service", "Service", "Service", "StatefulSet",
                     "StatefulSet"]
    seen = {}
    for doc, container in containers(docs):
        command = container["command"]
        assert command[0] == "mooncake-jax" and command[1] in ROLES, command
        argv = [re.sub(r"\$\((\w+)\)", lambda m: POD_VALUES[m.group(1)], a) for a in command[1:]]
        try:
            args = cli.build_parser(command[1]).parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc['metadata']['name']}: the CLI refuses {command}")
        seen[doc["metadata"]["name"]] = args
        if args.command == "instance":  # the whole instance config is valid, not only each flag
            from mooncake_jax.instance.main import config_from_args

            config = config_from_args(args, "token")
            assert (config.instance_id, config.advertise) == ("mooncake-prefill-0", "10.0.0.1:7000")
        ports = listen_ports(args)
        declared = {p["containerPort"] for p in container["ports"]}
        assert ports <= declared, (doc["metadata"]["name"], ports, declared)
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] in ports, (doc["metadata"]["name"], probe)
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["MOONCAKE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "mooncake-token"
        for name in re.findall(r"\$\((\w+)\)", " ".join(command)):
            assert name in env, f"{doc['metadata']['name']} uses $({name}) but does not set it"
    assert {a.role for a in seen.values() if a.command == "instance"} == {"prefill", "decode"}
    conductor_port = next(int(a.listen.rpartition(":")[2]) for a in seen.values() if a.command == "conductor")
    for args in seen.values():  # everyone reaches the Conductor through its Service, on its port
        target = getattr(args, "conductor_address", None) or getattr(args, "conductor", None)
        if args.command != "conductor":
            assert target == f"mooncake-conductor:{conductor_port}", target


def test_services_select_pods_and_reach_their_ports():
    docs = manifests()
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matched = [p for p in pods.values() if all(p["spec"]["template"]["metadata"]["labels"].get(k) == v
                                                   for k, v in selector.items())]
        assert len(matched) == 1, service["metadata"]["name"]
        declared = {port["containerPort"] for c in matched[0]["spec"]["template"]["spec"]["containers"]
                    for port in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= declared
    for workload in (d for d in docs if d["kind"] == "StatefulSet"):
        assert workload["spec"]["serviceName"] in {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["metadata"]["name"] == "mooncake-token" and "token" in secret["stringData"]


def test_dockerfile_runs_the_command_with_documented_jax_builds():
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["mooncake-jax"]' in text
    assert "ARG JAX_EXTRA" in text and "cuda12" in text and "tpu" in text
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (DEPLOY.parent / copied).exists(), copied
