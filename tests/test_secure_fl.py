"""Secure rounds over Flower's SecAgg+ (aegis.fl.secure): the server sees only the sum, each client adds
a 1/sqrt(t) share of the flood, the mask generator is a cipher, server tricks are refused, the
accountant states epsilon, and candidate verification on the sum stays at its null."""
import importlib
import math

import numpy as np
import pytest
import torch
import transformers
from flwr.app import Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import bytes_to_ndarray
from flwr.common.serde import message_from_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # type: ignore[attr-defined]
from flwr.server.workflow import SecAggPlusWorkflow

from aegis import AegisConfig, protect
from aegis.config import Treatment
from aegis.fl.secure import REFUSAL, SecureGuard, SurvivorPin, check_quantisation, noise_share
from aegis.fl.secure import patch as secagg_patch
from aegis.fl.secure.accountant import epsilons, gaussian_epsilon, noise_multiplier, prv_epsilon, statement
from aegis.fl.secure.client import fitres_content
from aegis.fl.secure.rounds import run_secure_rounds
from fast_noise import fast_noise  # noqa: F401  (fixture)

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")
STAGE_FIELDS = {"setup": {"pk1", "pk2"}, "share_keys": {"dsts", "ctxts"},  # Flower 1.42's SecAgg+ replies
                "collect_masked_vectors": {"masked_params"}, "unmask": {"nids", "shares"}}


def tiny_gpt2(seed=0, vocab=200):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def lm_batch(seed, batch=2, length=6):
    ids = torch.randint(0, 200, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def data(clients=4, per_client=2):
    return [[lm_batch(100 * c + i) for i in range(per_client)] for c in range(clients)]


def client_sum(run, server_round):
    return {k: sum(t.updates[server_round][i].double() for t in run.trainers if server_round in t.updates)
            for i, k in enumerate(run.names)}


def assert_sum_to_quantisation(run, server_round, clients, clipping_range, q=2**22):
    """Each client's stochastic rounding moves an entry by less than one step 2c/q; the dequantised
    mean then passes through fp32 (relative 2^-23 of the shifted range N c)."""
    step = 2 * clipping_range / q
    want = client_sum(run, server_round)
    for k in run.names:
        err = float((run.sums[server_round][k] - want[k]).abs().max())
        assert err <= clients * step + clients * clipping_range * 2**-22, (k, err, step)


def refusals(run):
    """The clients' reasons (client side); the server only ever reads the constant REFUSAL."""
    sent = {d.reply.error.reason for d in run.grid.deliveries if d.reply.has_error() and d.node_id < 2000}
    assert sent <= {REFUSAL}
    return [reason for guard in run.guards for reason in guard.refusals]


# -- the mask generator ---------------------------------------------------------------------------
def test_cipher_masks_key_on_the_whole_secret_where_flowers_fold_collides():
    flower = secagg_patch.flower_generator()
    shapes = [(3, 4), (), (5,)]
    a, b = bytes(range(32)), bytearray(range(32))
    b[0] ^= 0xFF
    b[4] ^= 0xFF  # the same 32-bit XOR fold: Flower's generator cannot tell the two seeds apart
    b = bytes(b)
    assert all(np.array_equal(x, y) for x, y in zip(flower(a, 2**32, shapes), flower(b, 2**32, shapes)))
    ours_a, ours_b = secagg_patch.cipher_masks(a, 2**32, shapes), secagg_patch.cipher_masks(b, 2**32, shapes)
    assert [x.shape for x in ours_a] == shapes and all(x.dtype == np.int64 for x in ours_a)
    assert not np.array_equal(ours_a[0], ours_b[0])
    assert all(np.array_equal(x, y) for x, y in zip(ours_a, secagg_patch.cipher_masks(a, 2**32, shapes)))
    big = secagg_patch.cipher_masks(a, 2**32, [(200_000,)])[0]
    assert big.min() >= 0 and big.max() < 2**32
    # uniform on [0, 2^32): the mean is within 6 sd of 2^31 (sd of one word 2^32 / sqrt 12)
    assert abs(big.mean() - 2**31) <= 6 * 2**32 / math.sqrt(12 * big.size)
    with pytest.raises(ValueError, match="power-of-two"):
        secagg_patch.cipher_masks(a, 1000, shapes)


def test_install_fails_loudly_if_flowers_generator_is_not_the_one_it_knows(monkeypatch):
    workflow = importlib.import_module("flwr.server.workflow.secure_aggregation.secaggplus_workflow")

    secagg_patch.install()
    assert secagg_patch.installed()
    monkeypatch.setattr(workflow, "pseudo_rand_gen", lambda seed, num_range, dimensions_list: [])
    assert not secagg_patch.installed()
    with pytest.raises(RuntimeError, match="internals changed"):
        secagg_patch.install()
    with pytest.raises(RuntimeError, match="32-bit"):
        secagg_patch.require_installed()


def test_a_client_refuses_a_round_while_flowers_generator_is_in_place(monkeypatch):
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the package re-exports
    original = secagg_patch.flower_generator()
    monkeypatch.setattr(secagg_patch, "install", lambda: None)  # the server forgets to install it ...
    monkeypatch.setattr(mod, "pseudo_rand_gen", original)  # ... and the client module still has Flower's
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=SurvivorPin(3), clipping_range=1.0)
    assert run.sums == {} and len(refusals(run)) == 3 and all("32-bit" in r for r in refusals(run))


# -- rounds ---------------------------------------------------------------------------------------
def test_secure_fedsgd_sum_equals_the_clients_sum_with_the_cipher_masks(monkeypatch):
    calls = []
    masks = secagg_patch.cipher_masks

    def counting(seed, num_range, dimensions_list):
        calls.append(len(seed))
        return masks(seed, num_range, dimensions_list)

    secagg_patch.install()
    for name in ("flwr.common.secure_aggregation.secaggplus_utils", "flwr.client.mod.secure_aggregation.secaggplus_mod",
                 "flwr.server.workflow.secure_aggregation.secaggplus_workflow"):
        monkeypatch.setattr(importlib.import_module(name), "pseudo_rand_gen", counting)
    monkeypatch.setattr(secagg_patch, "cipher_masks", counting)  # the spy stands in for the installed generator
    model = tiny_gpt2()
    run = run_secure_rounds(model, data(4), rounds=2, pin=SurvivorPin(3), lr=0.5, clipping_range=1.0)
    assert run.strategy.survivors == {1: 4, 2: 4}
    # per round: each client masks with its private seed (32 bytes) and 3 pairwise keys; the server
    # removes the 4 private masks
    assert len(calls) == 2 * (4 * (1 + 3) + 4) and set(calls) == {32, 44}
    for r in (1, 2):
        assert_sum_to_quantisation(run, r, 4, 1.0)
    # FedSGD: the global model moved by -lr x the survivors' mean
    start = dict(protect(tiny_gpt2(), None, AegisConfig()).model.named_parameters())
    mean1 = {k: v / 4 for k, v in run.sums[1].items()}
    mean2 = {k: v / 4 for k, v in run.sums[2].items()}
    final = dict(run.model.named_parameters())
    for k in run.names:
        torch.testing.assert_close(final[k].detach().double(), start[k].detach().double() - 0.5 * (mean1[k] + mean2[k]),
                                   rtol=0, atol=1e-6)


def test_secure_fedavg_sums_pseudo_gradients_of_local_sgd_steps():
    run = run_secure_rounds(tiny_gpt2(), data(3, per_client=2), rounds=1, pin=SurvivorPin(3), algorithm="fedavg",
                            local_steps=2, lr=0.05)
    assert run.strategy.survivors == {1: 3}
    assert all(len(t.batches_used[1]) == 2 and len(t.tables[1]) == 2 for t in run.trainers)
    start = dict(protect(tiny_gpt2(), None, AegisConfig()).model.named_parameters())
    final = dict(run.model.named_parameters())
    want = client_sum(run, 1)
    for k in run.names:  # the server moved to the mean local model: global - lr x mean pseudo-gradient
        torch.testing.assert_close(final[k].detach().double(), start[k].detach().double() - 0.05 * want[k] / 3,
                                   rtol=0, atol=2e-6)


def test_a_dropout_leaves_the_sum_of_the_survivors():
    def absent(node, msg):
        configs = msg.content.config_records.get("secaggplus_configs", {})
        return node == 1003 and configs.get("stage") == "collect_masked_vectors"

    run = run_secure_rounds(tiny_gpt2(), data(4), rounds=1, pin=SurvivorPin(3), absent=absent, clipping_range=1.0)
    assert run.strategy.survivors == {1: 3} and 1 not in run.trainers[3].updates
    assert_sum_to_quantisation(run, 1, 3, 1.0)


# -- nothing in the clear --------------------------------------------------------------------------
def test_no_plain_text_leaves_a_client():
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=SurvivorPin(3), clipping_range=1.0)
    assert run.sums
    sent = [u.numpy().astype(np.float32).tobytes() for t in run.trainers for u in t.updates[1]]
    stages = []
    for node, stage, wire in run.grid.wire:
        proto = ProtoMessage()
        proto.ParseFromString(wire)
        msg = message_from_proto(proto)
        assert not msg.has_error() and msg.metadata.src_node_id == node
        content = msg.content
        stages.append(stage)
        for key, record in content.array_records.items():
            assert key == "fitres.parameters" and len(record) == 0, key  # the update's arrays were cleared
        assert {k: dict(v) for k, v in content.metric_records.items()} == (
            {"fitres.num_examples": {"num_examples": 1}} if stage == "collect_masked_vectors" else {})
        configs = {k: dict(v) for k, v in content.config_records.items()}
        assert set(configs.pop("secaggplus_configs")) == STAGE_FIELDS[stage]
        if stage == "collect_masked_vectors":
            assert configs == {"fitres.metrics": {}, "fitres.status": {"code": 0, "message": ""}}
        else:
            assert configs == {}
        for chunk in sent:  # no update's raw fp32 bytes anywhere on the wire (a 16-byte window of each)
            assert chunk[:16] not in wire
        if stage == "collect_masked_vectors":  # masked: uniform on [0, 2^32), mean within 6 sd of 2^31
            # (the quantised update itself lies in [0, 2^22])
            arrays = content["secaggplus_configs"]["masked_params"]
            masked = np.concatenate([bytes_to_ndarray(b).ravel() for b in arrays])
            assert masked.min() >= 0 and masked.max() < 2**32
            assert abs(masked.mean() - 2**31) <= 6 * 2**32 / math.sqrt(12 * masked.size)
    assert sorted(stages) == sorted(s for s in STAGE_FIELDS for _ in range(3))


def test_a_metric_or_a_count_in_the_reply_is_refused(monkeypatch):
    import aegis.fl.secure.client as secure

    def leaky(update):
        content = fitres_content(update)
        content.config_records["fitres.metrics"]["train-loss"] = 2.5
        return content

    monkeypatch.setattr(secure, "fitres_content", leaky)
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=SurvivorPin(3), clipping_range=1.0)
    assert run.sums == {}
    assert len(refusals(run)) == 3 and all("metrics would travel in the clear" in r for r in refusals(run))
    assert not any(stage == "collect_masked_vectors" for _, stage, _ in run.grid.wire)


# -- server tricks ---------------------------------------------------------------------------------
def test_a_threshold_below_the_pin_is_refused_at_setup():
    run = run_secure_rounds(tiny_gpt2(), data(4), rounds=1, pin=SurvivorPin(3), reconstruction_threshold=2,
                            clipping_range=1.0)
    assert run.sums == {} and len(refusals(run)) == 4
    assert all("reconstruction_threshold=2 is below this client's pin of 3" in r for r in refusals(run))
    assert {stage for _, stage, _ in run.grid.wire} == {"error"}  # not even a public key left


def test_a_threshold_at_half_the_shares_is_refused():
    run = run_secure_rounds(tiny_gpt2(), data(4), rounds=1, pin=SurvivorPin(2), reconstruction_threshold=2,
                            clipping_range=1.0)
    assert run.sums == {} and all("not above half of num_shares=4" in r for r in refusals(run))


class ClaimsDropouts(SecAggPlusWorkflow):
    """A server that tells the clients all but one of them dropped, to unmask a sum of one."""

    def unmask_stage(self, grid, context, state):
        state.active_node_ids = set(sorted(state.active_node_ids)[:1])
        return super().unmask_stage(grid, context, state)


def test_claimed_dropouts_below_the_pin_are_refused():
    run = run_secure_rounds(tiny_gpt2(), data(4), rounds=1, pin=SurvivorPin(3), workflow=ClaimsDropouts,
                            clipping_range=1.0)
    assert run.sums == {}
    unmask = [r for r in refusals(run) if "unmask" in r]
    assert unmask and all("claims dropouts" in r or "both active and dropped" in r for r in unmask)
    assert not any(stage == "unmask" for _, stage, _ in run.grid.wire)  # no share of any secret left


def sybil_app():
    """A client the server runs itself: SecAgg+ with an all-zero update (no noise share)."""
    app = ClientApp()

    @app.train(mods=[secaggplus_mod])
    def train(msg, context):
        arrays = msg.content.array_records["fitins.parameters"].values()
        return Message(fitres_content([torch.zeros(bytes_to_ndarray(a.data).shape) for a in arrays]), reply_to=msg)

    return app


def test_sybil_clients_outside_the_peers_are_refused():
    honest = SurvivorPin(3, peers=frozenset({1000, 1001, 1002}))
    sybils = {2000: sybil_app(), 2001: sybil_app()}
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=honest, extra_nodes=sybils, clipping_range=1.0)
    assert run.sums == {}
    honest_refusals = refusals(run)
    assert len(honest_refusals) == 3 and all("[2000, 2001] are not among" in r for r in honest_refusals)
    control = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=honest, clipping_range=1.0)
    assert control.strategy.survivors == {1: 3}


def test_a_plain_train_message_is_refused_before_training():
    from flwr.app import ConfigRecord, Context, MessageType, RecordDict

    from aegis.fl.grid import flower_runtime

    def must_not_train(msg, ctx):
        raise AssertionError("the guard must refuse before training")

    guard = SecureGuard(SurvivorPin(3))
    secagg_patch.install()
    with flower_runtime():
        plain = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), 1000, MessageType.TRAIN)
    ctx = Context(run_id=0, node_id=1000, node_config={}, state=RecordDict(), run_config={})
    reply = guard(plain, ctx, must_not_train)
    assert reply.has_error() and reply.error.reason == REFUSAL
    assert guard.refusals == ["not a SecAgg+ message: a secure client never sends its update outside SecAgg+"]


def test_pin_validation():
    with pytest.raises(ValueError, match="at least 2 survivors"):
        SurvivorPin(1)
    with pytest.raises(ValueError, match="cannot make min_survivors=3"):
        SurvivorPin(3, peers=frozenset({1, 2}))


# -- quantisation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    ({"max_weight": 1000.0}, "max_weight=1000.0"),
    ({"modulus_range": 2**24, "clients": 6}, "modulus_range=16777216"),
    ({"bound": 9.0}, "clipping_range=8.0"),
])
def test_quantisation_errors_name_the_parameter_and_the_fix(kwargs, named):
    args = {"clipping_range": 8.0, "quantization_range": 2**22, "modulus_range": 2**32, "max_weight": 1.0,
            "clients": 4, **kwargs}
    with pytest.raises(ValueError, match="SecAggPlusWorkflow") as err:
        check_quantisation(**args)
    assert named in str(err.value)
    check_quantisation(clipping_range=8.0, quantization_range=2**22, modulus_range=2**32, max_weight=1.0, clients=4,
                       bound=7.9)


def test_a_clipping_range_that_would_clip_the_noise_is_refused_before_sending():
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=SurvivorPin(3), clipping_range=1e-3)
    assert run.sums == {} and len(refusals(run)) == 3
    assert all("clipping_range=0.001" in r and "would clip them silently" in r for r in refusals(run))
    assert not any(stage == "collect_masked_vectors" for _, stage, _ in run.grid.wire)


@pytest.mark.parametrize("quantization_range, clipping_range", [(2, 1e6), (2**22, 1e12)],
                         ids=["1-bit-huge-range", "huge-range"])
def test_a_quantisation_step_above_the_noise_is_refused_before_sending(quantization_range, clipping_range):
    """Stochastic rounding to a step far above the share's noise sets what the sum carries: refused."""
    run = run_secure_rounds(tiny_gpt2(), data(3), rounds=1, pin=SurvivorPin(3), clipping_range=clipping_range,
                            quantization_range=quantization_range, modulus_range=2**62)
    assert run.sums == {} and len(refusals(run)) == 3
    assert all(f"quantization_range={quantization_range}" in r and "exceeds 1 x the update's smallest noise sd" in r
               for r in refusals(run))
    assert not any(stage == "collect_masked_vectors" for _, stage, _ in run.grid.wire)
    table = protect(tiny_gpt2(), None, AegisConfig()).public_params()
    noise = min(float(p[1]) for p in table.values() if float(p[1]) > 0) / math.sqrt(3)
    with pytest.raises(ValueError, match="quantisation step"):
        check_quantisation(clipping_range=clipping_range, quantization_range=quantization_range,
                           modulus_range=2**62, max_weight=1.0, clients=3, noise=noise)
    check_quantisation(clipping_range=noise * 2**21, quantization_range=2**22, modulus_range=2**62, max_weight=1.0,
                       clients=3, noise=noise)  # a step of exactly the noise sd passes


def test_noise_share_scales_sigma_only_and_restores_the_table():
    model = tiny_gpt2()
    shield = protect(model, None, AegisConfig(seed=5))
    before = torch.tensor(list(shield.public_params().values()))
    with noise_share(shield, 1 / math.sqrt(4)) as table:
        model(**lm_batch(1)).loss.backward()
        shield.mask_()
    torch.testing.assert_close(table[:, 1].double(), before[:, 1].double() / 2)
    torch.testing.assert_close(table[:, [0, 2, 3]].double(), before[:, [0, 2, 3]].double())
    assert torch.equal(torch.tensor(list(shield.public_params().values())), before)
    exported = shield.export()
    noise = exported["transformer.h.0.mlp.c_fc.weight"].double()  # rho = 0 in the default preset: pure noise
    rho, sigma = shield.public_params()["transformer.h.0.mlp.c_fc.weight"][:2]
    assert rho == 0.0
    n = noise.numel()  # the sample variance of n normals: relative sd sqrt(2 / n); 6 sd
    assert abs(float(noise.pow(2).mean()) / (sigma / 2) ** 2 - 1) <= 6 * math.sqrt(2 / n)
    with pytest.raises(ValueError, match="factor in"):
        with noise_share(shield, 1.5):
            pass


# -- the accountant ----------------------------------------------------------------------------------
def test_accountant_matches_the_exact_gaussian_composition_and_known_values():
    for z, k in ((5.0, 1), (5.0, 300), (2.0, 20)):
        exact = gaussian_epsilon(math.sqrt(k) / z, 1e-5)  # K Gaussian mechanisms = one with mu = sqrt(K)/z
        assert abs(prv_epsilon(z, k, 1.0, 1e-5) - exact) <= 0.02 * exact + 0.01, (z, k, exact)
        eps, rdp, method = epsilons(z, k, 1.0, 1e-5)
        assert (eps, method) == (exact, "exact") and rdp >= exact - 1e-9, (z, k, rdp, exact)
    eps, rdp, method = epsilons(1.0, 300, 0.01, 1e-5)  # Poisson sampling, the values dp-accounting gives too
    assert method == "prv" and abs(eps - 1.078) <= 0.02 and abs(rdp - 1.451) <= 0.01
    tiny = epsilons(1e-3, 4, 1.0, 1e-5)  # where the PRV grid would need > 100 GiB: exact, still finite
    assert tiny[2] == "exact" and 1e3 < tiny[0] <= tiny[1] < math.inf
    assert epsilons(math.inf, 10, 1.0, 1e-5)[:2] == (0.0, 0.0) and epsilons(0.0, 1, 1.0, 1e-5)[:2] == (math.inf,
                                                                                                       math.inf)


def test_noise_multiplier_whitens_each_tensor_by_its_noise():
    table = {"emb": (0.5, 2.0, 3.0, 0.1), "mlp": (0.25, 1.0, 2.0, 0.0), "ln": (0.0, 1.0, 5.0, 0.0)}
    shapes, modes = {"emb": (10, 4), "mlp": (4, 4), "ln": (4,)}, {"emb": "rows", "mlp": "matrix", "ln": "matrix"}
    # emb: 10 rows of 2 x 0.5 x 3 / 2 = 1.5; mlp: 2 x 0.25 x 2 / 1 = 1; ln carries no signal
    assert noise_multiplier(table, shapes, modes) == pytest.approx(1 / math.sqrt(10 * 1.5**2 + 1))
    assert noise_multiplier(table, shapes, modes, rows={"emb": 2}) == pytest.approx(1 / math.sqrt(2 * 1.5**2 + 1))
    assert statement(2.0, 3).epsilon == pytest.approx(epsilons(2.0, 3, 1.0, 1e-5)[0])


def test_a_run_states_its_epsilon_from_the_exports_per_example():
    run = run_secure_rounds(tiny_gpt2(), data(3, per_client=2), rounds=4, pin=SurvivorPin(3), clipping_range=1.0)
    privacy = run.privacy()
    assert privacy.compositions == 2  # 4 rounds over 2 batches per client: each batch exported twice
    assert 0 < privacy.epsilon <= privacy.epsilon_rdp < math.inf
    one = run_secure_rounds(tiny_gpt2(), data(3, per_client=2), rounds=1, pin=SurvivorPin(3), clipping_range=1.0)
    assert one.privacy().compositions == 1 and one.privacy().epsilon < privacy.epsilon
    assert "per example" in privacy.line()
    budget = run.privacy(at_budget=True)  # the preset's exposure budget as the composition count
    assert budget.compositions == AegisConfig().exposures and budget.noise_multiplier == privacy.noise_multiplier


# -- the shortcut (one batch of N x B examples + the full noise) ---------------------------------------
def test_shortcut_equals_real_rounds_where_no_clip_binds_and_carries_the_full_noise():
    from aegis.fl.secure.shortcut import shortcut_sum

    batches, pin = [lm_batch(100 + c) for c in range(3)], SurvivorPin(3)
    gaps = {}
    for clip in (20.0, 1.0):  # 20 x the public norm binds no client here; 1 x does
        signal = AegisConfig(rel_threshold=0.0, overrides={r: Treatment("rows", lam=0.0, rho=1.0, clip=clip)
                                                            for r in ROWS})
        run = run_secure_rounds(tiny_gpt2(), [[b] for b in batches], rounds=1, pin=pin,
                                config=[signal.replace(seed=c + 1) for c in range(3)], clipping_range=2.0)
        short = shortcut_sum(tiny_gpt2(), batches, signal, pin)
        gaps[clip] = max(float((run.sums[1][k] - short[k]).abs().max()) for k in ("transformer.wte.weight",
                                                                                 "transformer.wpe.weight"))
    assert gaps[20.0] <= 3 * (2 * 2.0 / 2**22) + 3 * 2.0 * 2**-22, gaps  # to quantisation
    assert gaps[1.0] > 1e3 * gaps[20.0], gaps  # where clients clip, the sum of clips is not the clip of the sum
    # the noise: sigma sqrt(N / t) per entry (N = 6, t = 3), on a pure-noise tensor (rho = 0)
    six = shortcut_sum(tiny_gpt2(), [lm_batch(200 + c) for c in range(6)], AegisConfig(seed=9), pin)
    rho, sigma = protect(tiny_gpt2(), None, AegisConfig()).public_params()["transformer.h.0.mlp.c_fc.weight"][:2]
    noise = six["transformer.h.0.mlp.c_fc.weight"]
    assert rho == 0.0
    assert abs(float(noise.pow(2).mean()) / (2 * sigma**2) - 1) <= 6 * math.sqrt(2 / noise.numel())


# -- attacks on the aggregate --------------------------------------------------------------------------
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(20)]
WEAK = Treatment("rows", lam=1.0, rho=0.3)  # the weakened defence of the candidates tests (no snr cap)
ROWS = ("token_embedding", "position_embedding", "lm_head")


@pytest.fixture(scope="module")
def verification_model():
    from aegis.models import default_decoder

    _, tok = default_decoder(arch="gpt2", n_layer=1)
    return tiny_gpt2(vocab=len(tok)), tok


def _verify(model, tok, config, truths, views, t=3):
    """One secure FedSGD round per truth (client 0 holds "my pin is <truth>", 2 others other texts),
    scored 1-of-20 on each view of the round sum."""
    from aegis.attacks.candidates import Verifier, secret_candidates, verification_accuracy
    from aegis.attacks.fingerprint import lm_batch as text_batch
    from aegis.fl.secure.audit import aggregate_views

    cands = secret_candidates("my pin is {}", PINS)
    verifier = Verifier(model, tok, config)
    obs = {v: [] for v in views}
    for trial, truth in enumerate(truths):
        batches = [[text_batch(tok, list(cands[truth].texts), model)]]
        batches += [[text_batch(tok, [f"client {c} reads page {trial} today"], model)] for c in range(t - 1)]
        configs = [config.replace(seed=1000 * trial + c) for c in range(t)]
        run = run_secure_rounds(model, batches, rounds=1, pin=SurvivorPin(t), config=configs)
        assert run.strategy.survivors == {1: t}
        found = aggregate_views(run, model, server_round=1, target=0)
        for v in views:
            obs[v].append(verifier.observe(found[v]))
    return {v: verification_accuracy(verifier, obs[v], truths, cands, ("likelihood",))["likelihood"]
            for v in views}


def test_verification_on_the_sum_reads_high_without_noise(verification_model, fast_noise):
    """Positive control through the same rounds and quantisation: the rows flood without noise (lam 0)."""
    model, tok = verification_model
    clean = AegisConfig(overrides={r: Treatment("rows", lam=0.0, rho=1.0) for r in ROWS})
    results = _verify(model, tok, clean, [3], ("worst", "realistic"))
    assert results["worst"].accuracy == 1.0 and results["realistic"].accuracy == 1.0, results


@pytest.mark.slow
def test_verification_on_the_sum_stays_at_its_null_in_the_worst_case(verification_model, fast_noise):
    """The default preset, one export per example (its budget): 8 trials of 1-of-20 per view; a
    chance-level attacker scores >= 3 hits with P = 0.6 %. The weakened rows (rho 0.3, no snr cap) on
    the same truths read above it (>= 3 hits of the worst case; measured 4 of 6 on 6 of these truths)."""
    model, tok = verification_model
    truths = [1, 4, 6, 9, 12, 15, 17, 19]
    for view, r in _verify(model, tok, AegisConfig(), truths, ("worst", "realistic")).items():
        assert r.null == 0.05 and round(r.accuracy * 8) <= 2, (view, r)
    weak = AegisConfig(overrides={r: WEAK for r in ROWS})
    assert round(_verify(model, tok, weak, truths, ("worst",))["worst"].accuracy * 8) >= 3
