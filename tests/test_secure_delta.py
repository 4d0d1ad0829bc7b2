"""Secure rounds in delta mode (aegis.fl.secure.delta_rounds, aegis.fl.secure.cohort): the noise share, user-level
accounting against hand-computed values, the batched LoRA cohort against DeltaShield clients, and the shortcut
sum against real SecAgg+ rounds."""
from __future__ import annotations

import math

import peft
import pytest
import torch

from aegis.accounting import calibrate_noise_multiplier, gaussian_epsilon, noise_multiplier, statement
from aegis.config import FROZEN, ROLES, AegisConfig, ExportMode, Treatment
from aegis.exposure import ExposurePolicy
from aegis.fl.secure import SurvivorPin
from aegis.fl.secure.cohort import Cohort, lora_state
from aegis.fl.secure.delta_rounds import (
    clip_delta,
    full_table,
    public_table,
    run_secure_delta_rounds,
    share_config,
    shortcut_delta_sum,
    user_noise_multiplier,
    user_privacy,
)
from aegis_kernels.reference import key_from_int
from families import VOCAB, build

LR = 1e-2


def adam(params):
    return torch.optim.AdamW(params, lr=LR)


def config(treatment: Treatment, **kw) -> AegisConfig:
    return AegisConfig(preset=dict.fromkeys(ROLES, FROZEN) | {"mlp_lora": treatment}, export=ExportMode.DELTA,
                       exposure=ExposurePolicy.OFF, **kw)


SIGNAL = Treatment("matrix", rho=1.0, clip=0.5)  # lam 0, no cap: sigma 0, the bare clipped delta
NOISY = Treatment("matrix", rho=1.0, clip=1.0, snr=3.0)


def lora_model(seed: int = 0, rank: int = 4):
    torch.manual_seed(seed)
    model = peft.get_peft_model(build("llama", seed), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B at a later round's state (not 0): both factors train from the first step
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    return model


def batch(seed: int, n: int = 2, length: int = 9) -> dict:
    ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class PublicIds:
    """A public loss over fixed token ids, restarted by reset() (PublicBatches without a tokenizer)."""

    def __init__(self, model):
        self.model, self.k = model, 0
        self.batches = [batch(900 + i)["input_ids"] for i in range(3)]

    def reset(self):
        self.k = 0

    def __call__(self):
        ids = self.batches[self.k % len(self.batches)]
        self.k += 1
        return self.model(input_ids=ids, labels=ids).loss


# -- the share -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("treatment", [NOISY, Treatment("matrix", rho=1.0, lam=0.5, clip=1.0)],
                         ids=["cap-sets-sigma", "lam-sets-sigma"])
def test_a_share_floods_with_sigma_over_root_t_and_the_same_clip(treatment):
    model = lora_model()
    full = public_table(model, config(treatment), PublicIds, optimizer=adam, steps=2)
    share = public_table(model, share_config(config(treatment), 4), PublicIds, optimizer=adam, steps=2)
    assert set(full) == set(share) and len(full) == 6  # A and B of gate, up, down
    for name, (rho, sigma, clip, _) in full.items():
        assert sigma > 0 and clip > 0
        assert share[name][0] == rho and share[name][2] == pytest.approx(clip, rel=1e-6)
        assert share[name][1] == pytest.approx(sigma / 2, rel=1e-5)
    assert full_table(share, 4)[name][1] == pytest.approx(sigma, rel=1e-5)
    with pytest.raises(ValueError, match="delta-mode"):
        share_config(AegisConfig(), 4)
    with pytest.raises(ValueError, match="survivors=0"):
        share_config(config(NOISY), 0)


# -- user-level accounting -----------------------------------------------------------------------------
def test_user_level_accountant_against_hand_computed_values():
    table = {"a": (1.0, 4.0, 3.0, 0.0), "b": (1.0, 2.0, 1.0, 0.0), "silent": (0.0, 1.0, 5.0, 0.0),
             "empty": (1.0, 0.0, 0.0, 0.0)}
    shapes = dict.fromkeys(table, (2, 2))
    z = user_noise_multiplier(table, shapes)  # a whole user added or removed: (3/4)^2 + (1/2)^2
    assert z == pytest.approx(1 / math.sqrt(0.75**2 + 0.5**2))
    assert noise_multiplier(table, shapes, dict.fromkeys(table, "matrix")) == pytest.approx(z / 2)  # one example
    # unsampled: K rounds are one Gaussian mechanism of mu = sqrt(K) / z; epsilon solves Balle and Wang's equation
    eps = user_privacy(z, rounds=4).epsilon
    mu = 2 / z
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    assert phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) == pytest.approx(1e-5, rel=1e-4)
    # Poisson-sampled: dp-accounting's PLD 1.068 and RDP 1.451 at z = 1, q = 0.01, 300 rounds (Opacus PRV 1.078)
    sampled = user_privacy(1.0, rounds=300, sample_rate=0.01)
    assert sampled.method == "prv" and sampled.epsilon == pytest.approx(1.078, abs=0.01)
    assert sampled.epsilon_rdp == pytest.approx(1.451, abs=0.002)
    # calibration inverts it: exactly sqrt(K) / mu without sampling, to its tolerance with sampling
    z8 = calibrate_noise_multiplier(8.0, 20)
    assert gaussian_epsilon(math.sqrt(20) / z8, 1e-5) <= 8.0 < gaussian_epsilon(math.sqrt(20) / (z8 / 1.002), 1e-5)
    zq = calibrate_noise_multiplier(3.0, 50, sample_rate=0.05, tolerance=1e-2)
    assert statement(zq, 50, sample_rate=0.05).epsilon <= 3.0 < statement(zq / 1.02, 50, sample_rate=0.05).epsilon
    with pytest.raises(ValueError, match="epsilon=0"):
        calibrate_noise_multiplier(0.0, 20)
    with pytest.raises(ValueError, match="sensitivity=0"):
        noise_multiplier(table, shapes, dict.fromkeys(table, "matrix"), sensitivity=0.0)


# -- the cohort ----------------------------------------------------------------------------------------
def delta_shield_clients(model, clients, treatment, epochs):
    """Each client's export from its own DeltaShield round (no noise under ``treatment``), from ``model``."""
    import copy

    from aegis.delta import DeltaShield

    out = []
    for batches in clients:
        local = copy.deepcopy(model)
        opt = adam([p for p in local.parameters() if p.requires_grad])
        shield = DeltaShield(local, opt, config(treatment), PublicIds(local))
        with shield.round() as rnd:
            for _ in range(epochs):
                for b in batches:
                    local(**b).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        out.append(rnd.delta)
    return out


def test_cohort_trains_each_client_as_its_own_delta_shield_round():
    model = lora_model()
    clients = [[batch(10 * c + j, length=9 - c) for j in range(2)] for c in range(3)]  # lengths differ: padding
    opened = Treatment("matrix", rho=1.0, clip=1e6)
    expected = delta_shield_clients(model, clients, opened, epochs=2)
    cohort = Cohort.from_peft(model)
    got = cohort.train(lora_state(model), clients, epochs=2, optimizer=adam, chunk=2)  # chunks of 2 and 1
    assert set(got) == set(expected[0]) and len(got) == 6
    for c in range(3):
        for name, value in expected[c].items():
            assert value.abs().max() > 1e-4  # it trained
            torch.testing.assert_close(got[name][c], value, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="same number of batches"):
        cohort.train(lora_state(model), [clients[0], clients[1][:1]], epochs=1, optimizer=adam)
    with pytest.raises(ValueError, match="no peft LoRA"):
        lora_state(build("llama"))


# -- the shortcut against real SecAgg+ rounds ----------------------------------------------------------
def test_shortcut_sum_matches_real_secure_delta_rounds_with_every_client_clipped():
    model, clients, pin = lora_model(), [[batch(20 + c, n=2)] for c in range(3)], SurvivorPin(3)
    run = run_secure_delta_rounds(model, clients, rounds=1, pin=pin, config=config(SIGNAL), public_loss=PublicIds,
                                  optimizer=adam, epochs=2, clipping_range=1.0)
    assert run.strategy.survivors == {1: 3} and not any(g.refusals for g in run.guards)
    table = public_table(model, config(SIGNAL), PublicIds, optimizer=adam, steps=2)
    deltas = Cohort.from_peft(model).train(lora_state(model), clients, epochs=2, optimizer=adam)
    clipped = [clip_delta({n: d[c] for n, d in deltas.items()}, table) for c in range(3)]
    total = {n: sum(c[n] for c in clipped) for n in table}
    short = shortcut_delta_sum(total, table, clients=3, pin=3, key=key_from_int(5))  # sigma 0: no noise
    step = 2 * 1.0 / 2**22  # SecAgg+'s quantisation step at clipping range 1
    gap = max(float((run.sums[1][n] - short[n].double()).abs().max()) for n in table)
    assert gap <= 3 * step, gap
    # every client clipped its own delta (the clip binds), so the sum of clips is not the clip of the sum
    raw = {n: sum(d[c] for c in range(3)) for n, d in deltas.items()}
    assert any(float(deltas[n][c].norm()) > table[n][2] * 1.01 for n in table for c in range(3))
    assert max(float((clip_delta(raw, table)[n] - total[n]).abs().max()) for n in table) > 1e3 * step
    # the global model moved by the mean of the clipped deltas
    plain = dict(run.model.named_parameters())
    initial = lora_state(model)
    for n in table:
        torch.testing.assert_close(plain[n].detach() - initial[n], short[n] / 3, atol=3 * step, rtol=0)


def test_secure_delta_rounds_carry_the_full_flood_and_state_user_level_epsilon():
    model, clients = lora_model(rank=8), [[batch(40 + c)] for c in range(3)]
    pin = SurvivorPin(2)  # n = 3 survivors of shares sigma / sqrt(2): sum noise sigma sqrt(3 / 2)
    configs = [config(NOISY, seed=11 + c) for c in range(3)]  # each client its own key (one key: one noise x 3)
    run = run_secure_delta_rounds(model, clients, rounds=1, pin=pin, config=configs,
                                  public_loss=PublicIds, optimizer=adam)
    assert run.strategy.survivors == {1: 3}
    ratio, count = 0.0, 0
    for name in run.names:
        signal = sum(clip_delta(t.raw[1], t.tables[1])[name].double() for t in run.trainers)
        sigma = full_table(run.trainers[0].tables[1], 2)[name][1]
        residual = run.sums[1][name] - signal
        ratio += float(residual.pow(2).sum()) / sigma**2
        count += residual.numel()
    assert abs(ratio / count / 1.5 - 1) <= 6 * math.sqrt(2 / count), ratio / count  # E[r^2] = 1.5 sigma^2
    # user level: the full flood's z (share sigma x sqrt(t)), one round, every client in it
    shapes = {n: tuple(p.shape) for n, p in run.trainers[0].model.named_parameters()}
    z = min(user_noise_multiplier(full_table(t.tables[1], 2), shapes) for t in run.trainers)
    assert z == pytest.approx(1 / (3.0 * math.sqrt(len(run.names))), rel=1e-5)  # cap S = 3 on each tensor
    assert run.privacy().epsilon == pytest.approx(user_privacy(z, rounds=1).epsilon)


def test_shortcut_noise_is_sigma_root_n_over_t_and_fails_closed():
    table = {"w": (1.0, 0.5, 1.0, 0.0)}
    out = shortcut_delta_sum({"w": torch.zeros(200, 500)}, table, clients=12, pin=3, key=key_from_int(3))
    ms = float(out["w"].double().pow(2).mean())
    assert abs(ms / (0.25 * 4) - 1) <= 6 * math.sqrt(2 / 100_000)
    with pytest.raises(ValueError, match="same tensors"):
        shortcut_delta_sum({"w": torch.zeros(2), "v": torch.zeros(2)}, table, clients=3, pin=3)
    with pytest.raises(ValueError, match="clients >= pin"):
        shortcut_delta_sum({"w": torch.zeros(2)}, table, clients=2, pin=3)
    with pytest.raises(ValueError, match="no delta for"):
        clip_delta({}, table)


# -- the recipe ----------------------------------------------------------------------------------------
def test_scale_recipe_sets_each_tensor_cap_so_the_user_level_z_is_the_target():
    import dataclasses

    from aegis.fl.secure.delta_rounds import VERIFICATION_AT_SCALE, ScaleRecipe

    model = lora_model()
    config = VERIFICATION_AT_SCALE.config(2.5, 6)
    table = public_table(model, config, PublicIds, optimizer=adam, steps=2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert len(table) == 6 and user_noise_multiplier(table, shapes) == pytest.approx(2.5, rel=1e-5)
    assert config.exposures == VERIFICATION_AT_SCALE.rounds  # a user's examples may be in every round
    recipe = dataclasses.replace(VERIFICATION_AT_SCALE, rounds=4, min_noise_multiplier=None)
    z = recipe.noise_multiplier(100, 100)  # q = 1: the exact composition of 4 rounds
    assert user_privacy(z, rounds=4).epsilon <= 8.0 < user_privacy(z / 1.02, rounds=4).epsilon
    assert dataclasses.replace(recipe, min_noise_multiplier=50.0).noise_multiplier(100, 100) == 50.0
    # the shipped recipe: its measured verification floor sets z at N* (epsilon 8 alone would give z ~0.6)
    assert VERIFICATION_AT_SCALE.noise_multiplier(1000, 13830) == pytest.approx(math.sqrt(2))
    assert VERIFICATION_AT_SCALE.noise_multiplier(10000, 13830) > math.sqrt(2)
    assert recipe.config(2.5, 6).treatments["mlp_lora"].snr == pytest.approx(1 / (2.5 * math.sqrt(6)))
    with pytest.raises(ValueError, match="z=0"):
        ScaleRecipe("x", 8.0, 4, 1, 4, 8, 1e-3, 1.0).config(0.0, 6)
    with pytest.raises(ValueError, match="clients=200, population=100"):
        recipe.noise_multiplier(200, 100)
