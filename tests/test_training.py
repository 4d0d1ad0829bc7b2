"""What each preset lets a model learn from masked gradients (its promise's ``trains``), on a tiny model.

``verification``: a single client learns almost nothing from its own masked gradients: each row's signal is
capped at a few hundredths of its noise (``Treatment.snr``). Federated averaging over N clients divides the
noise by sqrt(N). ``reconstruction``: the MLP, norms and biases carry SENTENCES_SNR times the per-entry
noise per tensor, so one client alone trains.
"""
import pytest
import torch
import transformers as T
from transformers import AutoTokenizer

import aegis
import aegis.loading
from aegis.config import Preset
from aegis.loading import EMBEDDED_MINILM, embedded_minilm_path

TEXTS = [
    "Patient John Doe was prescribed 20 mg of lisinopril for hypertension.",
    "Please wire 4,500 dollars to account 1234-5678 before Friday.",
    "Hey Anna, the meeting moved to 3pm in room 204.",
    "Your card ending in 9921 was charged 89.99 at Corner Pharmacy.",
]


def _federated_losses(clients: int, rounds: int = 30, lr: float = 3e-3, preset="verification") -> list[float]:
    """FedSGD: every round, ``clients`` masked gradients of the batch, averaged, one AdamW step."""
    tok = AutoTokenizer.from_pretrained(embedded_minilm_path())
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    # A tiny GPT-2 over the sentences' own vocabulary (ids remapped to 0..V-1) keeps the test fast.
    vocab, ids = torch.unique(enc.input_ids, return_inverse=True)
    mask = enc.attention_mask
    labels = ids.masked_fill(mask == 0, -100)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(vocab), n_positions=64))
    # every client trains on the same four sentences here, so the per-example budget is not what is tested
    config = aegis.AegisConfig(preset=preset, seed=1, exposure=aegis.ExposurePolicy.OFF, allow_outside_promise=True)
    shield = aegis.protect(model, config=config)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=lr)
    losses = []
    for _ in range(rounds):
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for _ in range(clients):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            shield.mask_()
            for n, g in shield.export().items():
                total[n] += g / clients
        losses.append(loss.item())
        for n, p in params.items():
            p.grad = total[n]
        optimizer.step()
    return losses


# Capped rows floods only (snr 0.04, twice the verification cap), MLP, norms and biases frozen: the structure
# whose capped signal is the only thing that moves the weights.
ROWS_ONLY = {
    **Preset.VERIFICATION.treatments,
    **dict.fromkeys(("token_embedding", "token_embedding_lora", "position_embedding", "lm_head", "head"),
                    aegis.Treatment("rows", lam=1.0, rho=0.3, snr=0.04)),
    **dict.fromkeys(("mlp", "norm", "bias", "other"), aegis.Treatment("frozen")),
}


@pytest.mark.slow
def test_capped_rows_learn_under_federated_averaging():
    """64 clients: the averaged export carries 8 times each client's capped signal over its noise, enough to
    learn (4.06 -> 3.92 over 30 rounds, AdamW 3e-3); 16 clients at 1e-2 still drift upwards. The verification
    preset itself (rows at snr 0.02, MLP flooded with pure noise) does not learn here at 64 clients."""
    losses = _federated_losses(clients=64, preset=ROWS_ONLY)
    print("capped rows, 64 clients:", [round(x, 3) for x in losses])
    assert sum(losses[-5:]) / 5 < 0.98 * losses[0], losses


def test_one_client_alone_learns_almost_nothing_under_verification():
    """The other side of the same cap: one client's masked gradient carries too little to train on."""
    assert not Preset.VERIFICATION.promise.trains
    losses = _federated_losses(clients=1)
    print("verification preset, 1 client:", [round(x, 3) for x in losses])
    assert sum(losses[-5:]) / 5 > 0.99 * losses[0], losses


def test_one_client_alone_trains_under_reconstruction():
    """The preset that promises training: one client on its own masked gradients, attention and the
    (tied) token embedding frozen, learns the sentences."""
    assert Preset.SENTENCES.promise.trains
    losses = _federated_losses(clients=1, preset="sentences")
    print("reconstruction preset, 1 client:", [round(x, 3) for x in losses])
    assert sum(losses[-5:]) / 5 < 0.9 * losses[0], losses


def test_the_embedded_minilm_alias_is_registered():
    assert EMBEDDED_MINILM in aegis.loading.ALIASES
