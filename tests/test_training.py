"""A real training loop still learns under the utility preset (issue 2 bar)."""
import torch
import transformers as T
from transformers import AutoTokenizer

import aegis
import aegis.loading
from aegis.loading import EMBEDDED_MINILM, embedded_minilm_path

TEXTS = [
    "Patient John Doe was prescribed 20 mg of lisinopril for hypertension.",
    "Please wire 4,500 dollars to account 1234-5678 before Friday.",
    "Hey Anna, the meeting moved to 3pm in room 204.",
    "Your card ending in 9921 was charged 89.99 at Corner Pharmacy.",
]


def test_utility_preset_still_lowers_the_loss():
    tok = AutoTokenizer.from_pretrained(embedded_minilm_path())
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    # A tiny GPT-2 over the sentences' own vocabulary (ids remapped to 0..V-1) keeps the test fast.
    vocab, ids = torch.unique(enc.input_ids, return_inverse=True)
    mask = enc.attention_mask
    labels = ids.masked_fill(mask == 0, -100)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(vocab), n_positions=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    shield = aegis.protect(model, optimizer, aegis.AegisConfig(preset="utility", seed=1))
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        assert shield.is_masked  # the step ran on the flooded gradient
        losses.append(loss.item())
    print("utility-preset losses:", [round(x, 3) for x in losses])
    # The flooded run must make real progress from the uniform start (ln V).
    assert sum(losses[-5:]) / 5 < 0.95 * losses[0], losses
    assert EMBEDDED_MINILM in aegis.loading.ALIASES
