"""One source of truth: the counts and ports in cgx-ps-config, and the shard's and workers'
commands it feeds, parsed by the real cgx-ps CLI, torchrun and the training script."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgx_ps.net.addresses import servers_from_env
from cgx_ps.examples import train as example_train  # the Job's training script (/app/examples/train.py)

from .dockerfiles import dockerfile_entrypoint, dockerfile_instructions
from .kubelet import container_env, expanded_args, init_args, parse_quantity, secret_file, shard_command
from .manifests import (DATA_PLANE_DIRS, DEPLOY, JOB_ID_FIELD, NODE_RANK_FIELD, RENDER_DIRS, REPO, SHARD_INDEX_FIELD,
                        TLS_DIRS, all_containers, config, container, one, shard_sts, worker_job)


# ---------------------------------------------------------------------------------------
# one source of truth: the ConfigMap


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_counts_and_ports_agree_with_the_configmap(rel):
    cfg = config(rel)
    shards, nodes = int(cfg["CGX_PS_NUM_SHARDS"]), int(cfg["CGX_PS_NUM_NODES"])
    port, metrics_port = int(cfg["CGX_PS_PORT"]), int(cfg["CGX_PS_METRICS_PORT"])
    sts, job = shard_sts(rel), worker_job(rel)
    assert sts["spec"]["replicas"] == shards
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes

    c = container(sts, "shard")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    expected = {"grpc": port, "metrics": metrics_port}
    if rel in TLS_DIRS:   # the kubelet probes a plaintext health-only port (test_tls_probes_...)
        expected["health"] = int(cfg["CGX_PS_HEALTH_PORT"])
    if rel in DATA_PLANE_DIRS:  # the raw data plane, opt-in: off by default (gRPC)
        expected["data"] = int(cfg["CGX_PS_DATA_PORT"])
    else:
        assert cfg["CGX_PS_DATA_PORT"] == "-1"
    assert ports == expected
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe_port = c[probe]["grpc"]["port"]
        assert isinstance(probe_port, int) and probe_port == expected.get("health", port), probe
    svc_ports = {p["name"]: p["port"] for p in one(rel, "Service", "cgx-ps-shard")["spec"]["ports"]}
    assert svc_ports == {name: number for name, number in expected.items() if name != "health"}
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(metrics_port)
    assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_workers_derive_shard_addresses_from_the_same_count(rel):
    cfg = config(rel)
    sts = shard_sts(rel)
    job = worker_job(rel)
    expected = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{cfg['CGX_PS_PORT']}"
                for i in range(int(cfg["CGX_PS_NUM_SHARDS"]))]
    downward = {NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"}
    for c in all_containers(job):
        env = container_env(rel, c, downward)
        assert env["CGX_PS_NUM_SHARDS"] == cfg["CGX_PS_NUM_SHARDS"]
        assert "{i}" in env["CGX_PS_SERVERS"], "use the {i} template, not a hand-written list"
        assert list(servers_from_env(env)) == expected
    worker = container(job, "worker")
    node_rank = [e for e in worker["env"] if e["name"] == "CGX_PS_NODE_RANK"]
    assert node_rank and node_rank[0]["valueFrom"]["fieldRef"]["fieldPath"] == NODE_RANK_FIELD
    assert container_env(rel, worker, downward)["CGX_PS_NUM_NODES"] == cfg["CGX_PS_NUM_NODES"]


# ---------------------------------------------------------------------------------------
# the shard command: the real CLI


def test_image_entrypoint_is_the_cli():
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert dockerfile_entrypoint(DEPLOY / dockerfile) == ["cgx-ps"]
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cgx-ps"] == "cgx_ps.cli:main"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_shard_command_parses_with_the_cli(rel):
    cfg = config(rel)
    sts = shard_sts(rel)
    c = container(sts, "shard")
    # the CLI's parse and the ServerConfig it builds: raises where the shard would refuse to start
    args, env, server_config = shard_command(rel)
    assert args.command == "server"
    assert args.host == "0.0.0.0"
    assert args.port == int(cfg["CGX_PS_PORT"])
    assert args.metrics_port == int(cfg["CGX_PS_METRICS_PORT"])
    assert args.num_shards == int(cfg["CGX_PS_NUM_SHARDS"]) == sts["spec"]["replicas"]
    assert args.shard_index == 1                                  # from the downward API
    assert args.round_timeout == float(cfg["CGX_PS_ROUND_TIMEOUT"])
    assert args.drain_timeout == float(cfg["CGX_PS_DRAIN_TIMEOUT"])
    assert args.max_inflight_mb == float(cfg["CGX_PS_MAX_INFLIGHT_MB"])
    assert args.log_level == cfg["CGX_PS_LOG_LEVEL"]
    assert args.error_feedback is (cfg["CGX_PS_ERROR_FEEDBACK"] not in ("", "0", "false"))
    index_env = [e for e in c["env"] if e["name"] == "CGX_PS_SHARD_INDEX"]
    assert index_env[0]["valueFrom"]["fieldRef"]["fieldPath"] == SHARD_INDEX_FIELD
    # Security: the token always; TLS (mutual) and the plaintext health port with the tls component.
    assert args.token_file == env["CGX_PS_TOKEN_FILE"]
    secret_file(sts, c, args.token_file)
    if rel in TLS_DIRS:
        assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
            env["CGX_PS_TLS_CERT"], env["CGX_PS_TLS_KEY"], env["CGX_PS_TLS_CLIENT_CA"])
        assert args.health_port == int(cfg["CGX_PS_HEALTH_PORT"]) > 0
        assert args.health_port not in (args.port, args.metrics_port)
    else:
        assert not (args.tls_cert or args.tls_key or args.tls_client_ca)
        assert args.health_port == -1
    if rel in DATA_PLANE_DIRS:
        # the raw data plane on, on its own port: the workers' auto takes it
        assert args.data_port == server_config.data_port == int(cfg["CGX_PS_DATA_PORT"]) > 0
        assert args.data_port not in (args.port, args.metrics_port)
    else:
        # off by default, and always under TLS (plaintext: a shard given both refuses to start)
        assert args.data_port == server_config.data_port == -1
    assert not args.metrics_host or args.metrics_host == args.host


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_grace_period_exceeds_drain_timeout(rel):
    drain = float(config(rel)["CGX_PS_DRAIN_TIMEOUT"])
    grace = shard_sts(rel)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The drain itself, then closing streams and the metrics server: leave 10 s for those.
    assert grace >= drain + 10


# ---------------------------------------------------------------------------------------
# the worker command: torchrun + the example training script


def _torchrun_args(rel: str):
    from torch.distributed.run import get_args_parser

    c = container(worker_job(rel), "worker")
    env = container_env(rel, c, {NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"})
    argv = expanded_args(c, env, "command") + expanded_args(c, env)
    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:]), env


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_worker_command_is_one_torchrun_per_node(rel):
    targs, env = _torchrun_args(rel)
    assert targs.standalone
    assert str(targs.nproc_per_node) == config(rel)["GPUS_PER_NODE"]
    # a failed rank restarts the pod's ranks in place (a new incarnation resuming from the checkpoint)
    assert targs.max_restarts == int(config(rel)["TORCHRUN_MAX_RESTARTS"]) >= 1
    assert targs.training_script == "/app/examples/train.py"
    # The image puts the package's example script at /app/examples/train.py.
    copies = [rest.split() for word, rest in dockerfile_instructions(DEPLOY / "Dockerfile") if word == "COPY"]
    assert ["cgx_ps/examples/train.py", "/app/examples/train.py"] in copies


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_worker_args_parse_with_the_training_script(rel):
    targs, env = _torchrun_args(rel)
    # the image copies cgx_ps/examples/train.py there (test_worker_command_is_one_torchrun_per_node)
    assert Path(targs.training_script).name == Path(example_train.__file__).name, targs.training_script
    args = example_train.build_parser().parse_args(targs.training_script_args)
    cfg = config(rel)
    assert args.epochs == int(cfg["TRAIN_EPOCHS"])
    assert args.batch_size == int(cfg["TRAIN_BATCH_SIZE"])
    assert args.compression == cfg["CGX_PS_COMPRESSION"]
    assert args.checkpoint == cfg["TRAIN_CHECKPOINT_DIR"] and args.checkpoint_every == int(cfg["TRAIN_CHECKPOINT_EVERY"])
    mounts = {m["mountPath"]: m["name"] for m in container(worker_job(rel), "worker")["volumeMounts"]}
    assert mounts.get(args.checkpoint) == "checkpoints", "checkpoints go to their own volume, not the container"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_job_shape(rel):
    job = worker_job(rel)
    spec = job["spec"]
    nodes = int(config(rel)["CGX_PS_NUM_NODES"])
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    # One lost node fails every node's round: allow at least one such incident, at most two.
    assert nodes <= spec["backoffLimit"] <= 2 * nodes
    pod = spec["template"]["spec"]
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m["name"] for m in container(job, "worker")["volumeMounts"]}
    assert mounts.get("/dev/shm") == "dshm"
    limit = parse_quantity(container(job, "worker")["resources"]["limits"]["memory"])
    assert parse_quantity(shm[0]["emptyDir"]["sizeLimit"]) < limit, "/dev/shm counts against the memory limit"
    # a drained or preempted pod is replaced without using up backoffLimit
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    init = container(job, "wait-for-shards", init=True)
    assert "command" not in init, "the image's entrypoint (the cgx-ps CLI) runs `cgx-ps wait-for-shards`"
    assert init_args(init).command == "wait-for-shards"
