"""Secure rounds as the Flower app (aegis.fl.secure.app): in process, on Flower's simulation runtime
(`flwr run`, Ray) and on the deployment engine (SuperLink + SuperNodes, TLS, node authentication).

Each side records what it saw under $AEGIS_FL_RECORD_DIR (aegis.fl.secure.record): the server's masked
vectors before unmasking and its unmasked sum, each client's own plain update. The checks: the sum is
the survivors' sum to quantisation, every masked vector is uniform mod the modulus (a plain quantised
update lies in [0, quantization_range], 2^-10 of it), and the cipher masks were installed.
"""
import importlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.server.workflow import SecAggPlusWorkflow

from aegis.exposure import create_state
from aegis.fl.grid import flower_runtime
from aegis.fl.secure import REFUSAL as GUARD_REFUSAL
from aegis.fl.secure import SurvivorPin
from aegis.fl.secure import patch as secagg_patch
from aegis.fl.secure.app import PIN_ENV, node_pin, secure_settings
from aegis.fl.secure.record import RECORD_ENV
from aegis.fl.secure.rounds import run_secure_rounds
from aegis.fl.secure.server import SecAggPlus
from aegis.fl.simulation import simulate
from test_secure_fl import assert_sum_to_quantisation, data, tiny_gpt2

README = Path(__file__).resolve().parents[1] / "python" / "aegis" / "fl" / "README.md"
TINY = {"model-layers": 1, "model-width": 32, "model-heads": 2}  # the app's decoder, random, small
BIN = os.path.dirname(sys.executable)


def check_round(record: Path, server_round: int) -> list[int]:
    """The server's sum of the round equals the survivors' plain updates to quantisation, and what it
    received per node is uniform mod the modulus. Returns the survivors (nodes whose masked vector arrived)."""
    setup = json.loads((record / "setup.json").read_text())
    assert setup["patched"] is True  # the ServerApp's process unmasked with the cipher masks
    survivors = sorted(json.loads((record / f"round{server_round}-collect_masked_vectors.json").read_text())["ok"])
    c, q, m = setup["clipping_range"], setup["quantization_range"], setup["modulus_range"]
    sums = np.load(record / f"round{server_round}-sum.npz")
    updates = [np.load(record / f"client-node{n}-round{server_round}.npz") for n in survivors]
    n = len(survivors)
    # each client's stochastic rounding moves an entry by less than one step 2c/q; the dequantised mean
    # then passes through fp32 (relative 2^-23 of the shifted range n c)
    tolerance = n * 2 * c / q + n * c * 2**-22
    moved = 0.0
    for i, name in enumerate(setup["names"]):
        want = sum(u[f"arr_{i}"] for u in updates)
        assert float(np.abs(sums[name] - want).max()) <= tolerance, name
        moved = max(moved, float(np.abs(want).max()))
    assert moved > 100 * tolerance  # the check has teeth: the sum is far from zero at this tolerance
    for node in survivors:
        masked = np.load(record / f"round{server_round}-masked-node{node}.npy")
        assert masked.min() >= 0 and masked.max() < m
        # uniform on [0, m): mean within 6 sd of m/2, and the share of entries in the quantised update's
        # range [0, q] within 6 sd of q/m (a plain update would have all of them there)
        assert abs(masked.mean() - m / 2) <= 6 * m / math.sqrt(12 * masked.size), node
        p = (q + 1) / m
        assert np.mean(masked <= q) <= p + 6 * math.sqrt(p * (1 - p) / masked.size), node
    return survivors


# -- in process: the app's code path ------------------------------------------------------------------
def test_secure_apps_mask_with_the_cipher_and_the_sum_is_the_clients(tmp_path, monkeypatch):
    calls = []
    masks = secagg_patch.cipher_masks

    def counting(seed, num_range, dimensions_list):
        calls.append(len(seed))
        return masks(seed, num_range, dimensions_list)

    secagg_patch.install()  # as tests/test_secure_fl.py: a spy stands in for the installed generator
    for name in ("flwr.common.secure_aggregation.secaggplus_utils", "flwr.client.mod.secure_aggregation.secaggplus_mod",
                 "flwr.server.workflow.secure_aggregation.secaggplus_workflow"):
        monkeypatch.setattr(importlib.import_module(name), "pseudo_rand_gen", counting)
    monkeypatch.setattr(secagg_patch, "cipher_masks", counting)
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "record"))
    monkeypatch.delenv(PIN_ENV, raising=False)
    context, _ = simulate(4, {"secure": True, "min-survivors": 3, "num-server-rounds": 1, **TINY},
                          node_config={"aegis-min-survivors": 3})
    assert list(context.state["secure"]["survivors"]) == [4]
    assert len(context.state["evaluation"]["validation-loss"]) == 2  # round 0 and round 1
    # each client masks with its private seed (32 bytes) and 3 pairwise keys; the server removes 4 masks
    assert len(calls) == 4 * (1 + 3) + 4 and set(calls) == {32, 44}
    assert check_round(tmp_path / "record", 1) == [1000, 1001, 1002, 1003]


def test_an_unpinned_node_refuses_a_secure_run(monkeypatch):
    monkeypatch.delenv(PIN_ENV, raising=False)
    # every node refuses at setup (not even a public key): the run ends with the error, not a silent exit
    with pytest.raises(RuntimeError, match=r"NO CLIENT REPLY WAS ACCEPTED IN 1 ROUND\(S\)"):
        simulate(3, {"secure": True, "min-survivors": 2, "num-server-rounds": 1, **TINY})


def test_a_pinned_node_answers_no_plain_round(monkeypatch, tmp_path):
    from aegis.fl.client_app import app

    monkeypatch.delenv(PIN_ENV, raising=False)
    secagg_patch.install()
    with flower_runtime():
        plain = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), 1000, MessageType.TRAIN)
    run_config = {**TINY}  # the server does not ask for a secure round ...
    store = str(create_state(tmp_path / "node.sqlite"))
    ctx = Context(run_id=0, node_id=1000, node_config={"aegis-min-survivors": 3, "aegis-exposure-state": store},
                  state=RecordDict(), run_config=run_config)
    reply = app(plain, ctx)  # ... but this node pins its survivors: SecAgg+ or nothing
    assert reply.has_error() and reply.error.reason == GUARD_REFUSAL


def test_the_pin_is_the_nodes_own(monkeypatch):
    monkeypatch.delenv(PIN_ENV, raising=False)

    def ctx(node_config, run_config=None):
        return Context(run_id=0, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config or {})

    # the run config (the server's) never sets it
    assert node_pin(ctx({}, {"min-survivors": 5, "aegis-min-survivors": 5})) is None
    pinned = node_pin(ctx({"aegis-min-survivors": 4, "aegis-peers": "7, 8 9,10"}))
    assert pinned == SurvivorPin(4, frozenset({7, 8, 9, 10}))
    monkeypatch.setenv(PIN_ENV, "3")
    assert node_pin(ctx({})) == SurvivorPin(3)
    assert node_pin(ctx({"aegis-min-survivors": 5})) == SurvivorPin(5)  # node config first
    with pytest.raises(ValueError, match="aegis-min-survivors = 'x'"):
        node_pin(ctx({"aegis-min-survivors": "x"}))
    with pytest.raises(ValueError, match="at least 2 survivors"):
        node_pin(ctx({"aegis-min-survivors": 1}))


@pytest.mark.parametrize("workflow", [SecAggPlus, SecAggPlusWorkflow])
def test_a_node_that_drops_before_sharing_its_keys_leaves_the_round(workflow):
    def absent(node, msg):  # node 1003 answers setup, then is gone
        return node == 1003 and msg.content.config_records.get("secaggplus_configs", {}).get("stage") == "share_keys"

    run = run_secure_rounds(tiny_gpt2(), data(4), rounds=1, pin=SurvivorPin(3), absent=absent, clipping_range=1.0,
                            workflow=workflow)
    if workflow is SecAggPlusWorkflow:  # Flower's own asks the survivors for shares of 1003's key: none has one
        refusals = [r for guard in run.guards[:3] for r in guard.refusals]
        assert run.sums == {} and len(refusals) == 3 and all("KeyError: 1003" in r for r in refusals)
    else:
        assert run.strategy.survivors == {1: 3}
        assert_sum_to_quantisation(run, 1, 3, 1.0)


def test_fedavg_rounds_take_fresh_batches():
    """Round r trains on batches (r-1)E .. rE-1: no batch is exported twice (the exposure budget would
    refuse the second round of overlapping windows)."""
    run = run_secure_rounds(tiny_gpt2(), data(3, per_client=4), rounds=2, pin=SurvivorPin(3), algorithm="fedavg",
                            local_steps=2, lr=0.05, clipping_range=1.0)
    assert run.strategy.survivors == {1: 3, 2: 3} and not any(g.refusals for g in run.guards)
    for trainer in run.trainers:
        used = [id(b) for r in (1, 2) for b in trainer.batches_used[r]]
        assert used == [id(b) for b in trainer.batches]


@pytest.mark.parametrize("run_config, named", [
    ({"aggregation": "fedprox"}, "'aggregation' = 'fedprox'"),
    ({"min-survivors": 1}, "'min-survivors' = 1"),
    ({"local-steps": 0}, "'local-steps' = 0"),
    ({"min-nodes": 2, "min-survivors": 3}, "'min-nodes' = 2 is below 'min-survivors' = 3"),
    ({"secagg-timeout": 0}, "'secagg-timeout' = 0"),
])
def test_secure_settings_name_the_key_and_the_fix(run_config, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        secure_settings(run_config)


# -- flwr run: simulation runtime and deployment engine ---------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _legacy_loopback() -> list[str]:
    """Flower 1.42's SuperLink still opens its gRPC Fleet and Control APIs, on 0.0.0.0:9092/9093 unless
    told otherwise: loopback, on free ports."""
    return ["--fleet-api-address", f"127.0.0.1:{_free_port()}", "--control-api-address", f"127.0.0.1:{_free_port()}"]


def _project(tmp_path: Path) -> Path:
    """The README's app project (the same components run plain and secure rounds)."""
    project = tmp_path / "app"
    project.mkdir()
    (project / "pyproject.toml").write_text(re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1))
    (project / "LICENSE").write_text("Apache-2.0\n")
    return project


def _env(tmp_path: Path, **extra) -> dict:
    home = tmp_path / "flwr-home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": BIN + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
            RECORD_ENV: str(tmp_path / "record"), **extra}


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL a process we started and the processes it started (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _run_config(aggregation: str, rounds: int, survivors: int, nodes: int, timeout: int) -> str:
    return (f'secure=true aggregation="{aggregation}" min-survivors={survivors} min-nodes={nodes} '
            f"num-server-rounds={rounds} local-steps=2 lr=0.05 secagg-timeout={float(timeout)} "
            + " ".join(f"{k}={v}" for k, v in TINY.items()))


@pytest.mark.slow
# FedAvg: 1 round of 2 local steps trains on the texts FedSGD's 2 rounds do. The simulated nodes count their
# exposures per run, each its own, and later texts of the corpus share 8-token windows across partitions.
@pytest.mark.parametrize("aggregation, rounds", [("fedsgd", 2), ("fedavg", 1)])
def test_secure_rounds_on_the_simulation_runtime(tmp_path, aggregation, rounds):
    """`flwr run` of the README's project on a simulation SuperLink (Ray); the nodes' pin comes from
    their own environment (the simulation's SuperNodes are processes of the SuperLink's host)."""
    pytest.importorskip("ray")
    port, project = _free_port(), _project(tmp_path)
    env = _env(tmp_path, **{PIN_ENV: "3"})
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    superlink = subprocess.Popen(
        [f"{BIN}/flower-superlink", "--insecure", "--simulation", "--host", "127.0.0.1", "--port", str(port),
         *_legacy_loopback()],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        run = subprocess.run(
            [f"{BIN}/flwr", "run", str(project), "test", "--stream", "--run-config",
             _run_config(aggregation, rounds, 3, 4, 120), "--federation-config", "num-supernodes=4"],
            env=env, capture_output=True, text=True, timeout=500)
    finally:
        _stop(superlink)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    for r in range(1, rounds + 1):
        assert f"aegis secure round {r}: 4 survivors" in log, log[-3000:]
        assert len(check_round(tmp_path / "record", r)) == 4


def _tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 / localhost signed by it (ca.crt, server.pem, server.key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, issuer, key, signer, ca, san=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aegis test CA")])
    ca = certificate(ca_name, ca_name, ca_key, ca_key, True)
    server = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_name, server_key,
                         ca_key, False, [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths = directory / "ca.crt", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return paths


def _node_key(directory: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (P-384, OpenSSH format, as Flower's node authentication reads)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private, public = directory / name, directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def _wait_for(condition, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_secure_rounds_on_the_deployment_engine(tmp_path):
    """SuperLink + 4 SuperNodes on loopback with TLS and node authentication (CLI-managed: only keys
    registered with `flwr supernode register` connect), `flwr run`; one SuperNode is killed after the
    setup stage. The round completes with the 3 survivors, what the server received per node is masked,
    and its sum is the survivors' sum. A fifth SuperNode with an unregistered key never joins."""
    nodes, victim, started = 4, 3, time.monotonic()
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, server_cert, server_key = _tls(certs)
    port, project, env = _free_port(), _project(tmp_path), _env(tmp_path)
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{ca}"\n')
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen([f"{BIN}/{args[0]}", *args[1:]], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    try:
        superlink = start("superlink", "flower-superlink", "--ssl-ca-certfile", str(ca), "--ssl-certfile",
                          str(server_cert), "--ssl-keyfile", str(server_key), "--enable-supernode-auth",
                          "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port),
                          *_legacy_loopback())
        _wait_for(lambda: _listening(port), 120, "the SuperLink", [superlink])
        keys, ids = [_node_key(certs, f"node{i}") for i in range(nodes)], []
        for _, public in keys:
            registered = subprocess.run([f"{BIN}/flwr", "supernode", "register", str(public), "test", "--format",
                                         "json"], env=env, capture_output=True, text=True, timeout=120)
            found = re.search(r'"node-id":\s*(\d+)', registered.stdout)
            assert registered.returncode == 0 and found, registered.stdout + registered.stderr
            ids.append(int(found.group(1)))
        peers = ",".join(map(str, ids))  # the allow-list: node ids the SuperLink authenticates
        supernodes = []
        for i, (private, _) in enumerate(keys):
            store = create_state(tmp_path / f"node{i}-exposure.sqlite")  # a deployed node names its store
            config = (f'partition-id={i} num-partitions={nodes} aegis-min-survivors=3 aegis-peers="{peers}" '
                      f'aegis-exposure-state="{store}"')
            supernodes.append(start(f"supernode{i}", "flower-supernode", "--root-certificates", str(ca),
                                    "--superlink", f"127.0.0.1:{port}", "--auth-supernode-private-key", str(private),
                                    "--port", str(_free_port()), "--node-config", config))
        intruder_key, _ = _node_key(certs, "intruder")  # never registered
        intruder = start("intruder", "flower-supernode", "--root-certificates", str(ca), "--superlink",
                         f"127.0.0.1:{port}", "--auth-supernode-private-key", str(intruder_key), "--port",
                         str(_free_port()), "--node-config", "partition-id=0 num-partitions=4 aegis-min-survivors=3")
        flwr_run = start("flwr-run", "flwr", "run", str(project), "test", "--stream", "--run-config",
                         _run_config("fedsgd", 1, 3, nodes, 60))
        record = tmp_path / "record"
        _wait_for(lambda: (record / "round1-setup.json").exists(), 400, "the setup stage", [superlink, flwr_run])
        _stop(supernodes[victim])  # mid-round: after its public keys, before its masked vector
        _wait_for(lambda: flwr_run.poll() is not None, 400, "flwr run")
        log = (logs / "flwr-run.log").read_text()
        assert flwr_run.returncode == 0, log[-3000:]
        setup = json.loads((record / "round1-setup.json").read_text())
        assert sorted(setup["ok"]) == sorted(ids)  # the registered nodes, and only them
        survivors = check_round(record, 1)
        assert survivors == sorted(set(ids) - {ids[victim]})
        assert "aegis secure round 1: 3 survivors" in log, log[-3000:]
        assert intruder.poll() is not None or "SuperNode ID" not in (logs / "intruder.log").read_text()
    finally:
        for proc in procs:
            _stop(proc)
    print(f"deployment engine: {time.monotonic() - started:.0f} s")
