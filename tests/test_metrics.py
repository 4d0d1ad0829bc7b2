"""ROUGE with DAGER's alignments, token recall, exact rate and the matched null baseline."""
import pytest
import torch

from aegis.metrics import align, exact_rate, null_baseline, null_gradient, rouge, token_recall

REFS = ["My PIN is 4417, don't share it.", "Meet Dr. Osei at noon on Friday"]


def test_perfect_and_empty_reconstructions():
    assert rouge(REFS, REFS) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert rouge(["my pin is 4417 don t share it", "meet dr osei at noon on friday"], REFS)["rouge2"] == 1.0
    assert rouge([], REFS) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    with pytest.raises(ValueError):
        rouge(["x"], [])


def test_rouge_values_match_rouge_score_by_hand():
    # ref "a b c d", pred "a b d": R-1 P=3/3 R=3/4 -> F=6/7; bigram "a b" only: P=1/2 R=1/3 -> F=0.4; LCS 3.
    scores = rouge(["a b d"], ["a b c d"])
    assert scores["rouge1"] == pytest.approx(6 / 7)
    assert scores["rouge2"] == pytest.approx(0.4)
    assert scores["rougeL"] == pytest.approx(6 / 7)


def test_greedy_reuses_a_prediction_hungarian_does_not():
    preds = ["my pin is 4417 don't share it at noon"]
    assert align(preds, REFS, "greedy") == [0, 0]
    assert align(preds, REFS, "hungarian") == [0, None]
    assert rouge(preds, REFS, "greedy")["rouge1"] > rouge(preds, REFS, "hungarian")["rouge1"]
    # Greedy matches by position-wise agreement, not by bag overlap.
    assert align(["friday on noon at osei dr meet", "meet dr x x x x x"], REFS[1:], "greedy") == [1]
    with pytest.raises(ValueError, match="alignment"):
        align(preds, REFS, "best")


def test_token_recall_and_exact_rate():
    assert token_recall(["pin 4417 friday"], REFS) == pytest.approx(3 / 15)  # 15 distinct words
    assert token_recall([], REFS) == 0.0
    assert exact_rate(["MEET dr osei at noon, on friday!"], REFS) == 0.5

    class Chars:  # a stand-in tokenizer: one token per character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    assert token_recall(["ab"], ["abc"], tokenizer=Chars()) == pytest.approx(2 / 3)


def test_null_gradient_matches_norms_and_keeps_closed_channels_closed():
    grads = {"w": torch.randn(30, 20) * 5, "b": torch.zeros(7), "h": torch.randn(4, dtype=torch.float64)}
    null = null_gradient(grads, seed=1)
    assert set(null) == set(grads)
    for name, g in grads.items():
        assert null[name].shape == g.shape and null[name].dtype == g.dtype
        assert float(null[name].norm()) == pytest.approx(float(g.norm()), rel=1e-5)
    assert not null["b"].any()
    assert torch.equal(null["w"], null_gradient(grads, seed=1)["w"])
    assert abs(float(torch.nn.functional.cosine_similarity(null["w"].flatten(), grads["w"].flatten(), 0))) < 0.2


def test_null_baseline_runs_the_attack_on_the_null_gradient():
    grads = {"w": torch.randn(8, 8)}
    seen = {}

    def attack(model, g, tokenizer, batch_size):
        seen.update(g)
        return ["my pin is 4417"] if batch_size == 1 else []

    class Decoder(torch.nn.Module):
        config = type("Cfg", (), {"model_type": "gpt2"})()

    scores = null_baseline(attack, Decoder(), grads, None, 1, REFS)
    assert torch.equal(seen["w"], null_gradient(grads)["w"])
    assert scores == rouge(["my pin is 4417"], REFS, "greedy")
