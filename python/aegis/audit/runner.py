"""The main job: federated rounds with each defence, every shared gradient attacked, utility measured.

For each model (the embedded decoder and encoder unless named otherwise) and each defence, the clients
run FedSGD rounds through Flower's Message API (``aegis.fl.run_rounds``); the honest-but-curious server
keeps every gradient it receives and runs the whole attack suite on those of the first
``attack_rounds`` rounds (all with 0), each with its own copy of the global model of that round. Utility is the global model's validation perplexity (decoder) or accuracy and
macro-F1 (encoder) after the last round.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..data import Example, load_corpus, load_texts

ATTACKS = ("dager", "embedding_norm", "mlp_span", "spectral", "tag")
DEFAULT_ATTACKS = ("dager", "embedding_norm", "mlp_span", "spectral")
DEFENCES = (
    "none",
    "aegis-paper",
    "aegis-utility",
    "dp-noise-0.001",
    "dp-noise-0.01",
    "dp-noise-0.1",
    "dp-sgd-C1-z1",
    "prune-50",
    "prune-90",
    "prune-99",
    "soteria-80",
)
MODELS = ("decoder", "encoder")
QUICK_DEFENCES = ("none", "aegis-paper", "aegis-utility", "dp-noise-0.01", "dp-sgd-C1-z1", "prune-90", "soteria-80")


@dataclass(frozen=True)
class AuditConfig:
    """What the audit runs. ``quick()`` is the under-3-minutes variant."""

    models: tuple[str, ...] = MODELS
    defences: tuple[str, ...] = DEFENCES
    attacks: tuple[str, ...] = DEFAULT_ATTACKS
    clients: int = 2
    rounds: int = 3
    batch_size: int = 4
    # The server keeps every round's gradients; the attacks read the first N rounds' (0: every round).
    # Round 1's model is the one every client starts from; attacking all 3 rounds of the full default
    # took 3090 s on 2 cores (the bar is 20 min) for the same verdicts.
    attack_rounds: int = 1
    decoder_lr: float = 1e-3
    encoder_lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    decoder: str | None = None  # HF causal LM name / path; None: the embedded default decoder
    encoder: str | None = None  # HF sequence-classification name / path; None: embedded MiniLM
    dataset: str | None = None  # local file or HF dataset; None: the shipped corpus
    max_eval: int = 80  # validation sentences used for utility

    @staticmethod
    def quick(**changes) -> "AuditConfig":
        # One setting per baseline family keeps every family in the report.
        base = {"models": ("decoder",), "defences": QUICK_DEFENCES, "rounds": 2, "batch_size": 2}
        return AuditConfig(**{**base, **changes})

    def __post_init__(self) -> None:
        for name, values, allowed in (("models", self.models, MODELS), ("attacks", self.attacks, ATTACKS)):
            unknown = set(values) - set(allowed)
            if unknown:
                raise ValueError(f"{name}: unknown {sorted(unknown)}; choose from {allowed}")
        if self.clients < 1 or self.rounds < 1 or self.batch_size < 1:
            raise ValueError("clients, rounds and batch_size must be >= 1")
        if self.attack_rounds < 0:
            raise ValueError(f"attack_rounds={self.attack_rounds}: must be >= 0 (0 attacks every round)")


@dataclass
class Progress:
    """Callbacks for the CLI's progress bars (no-ops by default)."""

    total: Callable[[int], None] = lambda n: None
    advance: Callable[[str], None] = lambda label: None


def _examples(config: AuditConfig) -> tuple[list[Example], list[Example]]:
    if config.dataset is None:
        return load_corpus("train"), load_corpus("validation")
    train = load_texts(config.dataset, split="train")
    try:
        validation = load_texts(config.dataset, split="validation")
    except (ValueError, KeyError):
        cut = max(1, len(train) // 5)
        train, validation = train[cut:], train[:cut]
    return train, validation


def _load_model(kind: str, config: AuditConfig, num_labels: int):
    from ..models import default_decoder, default_encoder

    if kind == "decoder":
        return default_decoder(name=config.decoder, seed=config.seed)
    return default_encoder(num_labels=num_labels, name=config.encoder, seed=config.seed)


def _batch(tokenizer, examples: list[Example], kind: str, label_ids: dict[str, int]) -> dict[str, torch.Tensor]:
    enc = tokenizer([e.text for e in examples], padding=True, truncation=True, max_length=64, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if kind == "decoder":
        batch["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    else:
        batch["labels"] = torch.tensor([label_ids[e.label] for e in examples])
    return batch


def _client_batches(train: list[Example], config: AuditConfig, tokenizer, kind: str, label_ids) -> list[list[dict]]:
    """Disjoint private batches per client, one per round, drawn with the audit's seed."""
    pool = list(train)
    random.Random(config.seed).shuffle(pool)
    need = config.clients * config.rounds * config.batch_size
    if len(pool) < need:
        raise ValueError(f"the dataset has {len(pool)} training sentences; {need} are needed: lower --rounds/--clients/--batch-size")
    batches = [[] for _ in range(config.clients)]
    for r in range(config.rounds):
        for c in range(config.clients):
            start = (r * config.clients + c) * config.batch_size
            batches[c].append(_batch(tokenizer, pool[start : start + config.batch_size], kind, label_ids))
    return batches


def _evaluator(kind: str, tokenizer, validation: list[Example], label_ids, max_eval: int):
    examples = validation[:max_eval]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        model.eval()
        batch = _batch(tokenizer, examples, kind, label_ids)
        out = model(**batch)
        if kind == "decoder":
            loss = float(out.loss)
            return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        from sklearn.metrics import f1_score

        pred = out.logits.argmax(-1)
        return {
            "val_loss": float(out.loss),
            "accuracy": float((pred == batch["labels"]).float().mean()),
            "f1": float(f1_score(batch["labels"], pred, average="macro", zero_division=0)),
        }

    return evaluate


def _attack_fn(name: str):
    from .. import attacks

    return getattr(attacks, name)


def _score(predictions: list[str], references: list[str], tokenizer, kind: str) -> dict[str, float]:
    from .. import metrics

    scores = metrics.rouge(predictions, references, alignment="greedy" if kind == "decoder" else "hungarian")
    return {
        "rouge1": scores["rouge1"],
        "rouge2": scores["rouge2"],
        "rougeL": scores["rougeL"],
        "token_recall": metrics.token_recall(predictions, references, tokenizer),
        "exact_rate": metrics.exact_rate(predictions, references),
    }


def _references(tokenizer, batch: dict[str, torch.Tensor]) -> list[str]:
    return [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def run_audit(config: AuditConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run everything; returns the report dict that ``aegis.audit.report`` writes out."""
    from ..fl import run_rounds

    progress = progress or Progress()
    train, validation = _examples(config)
    labels = sorted({e.label for e in train + validation if e.label is not None})
    label_ids = {name: i for i, name in enumerate(labels)}
    if "encoder" in config.models and len(labels) < 2:
        raise ValueError("the encoder task needs labelled data (at least two labels): pass a labelled --dataset or --models decoder")
    attack_rounds = config.attack_rounds or config.rounds
    per_defence = config.clients * attack_rounds * len(config.attacks)
    progress.total(len(config.models) * (len(config.defences) * (config.rounds + per_defence) + len(config.attacks)))

    results, utility, reconstructions, rounds_log = [], [], [], []
    started = time.time()
    for kind in config.models:
        model, tokenizer = _load_model(kind, config, num_labels=len(labels))
        client_batches = _client_batches(train, config, tokenizer, kind, label_ids)
        evaluate = _evaluator(kind, tokenizer, validation, label_ids, config.max_eval)
        lr = config.decoder_lr if kind == "decoder" else config.encoder_lr
        null = {}
        initial: list[tuple[dict[str, torch.Tensor], dict[str, float]]] = []  # every defence starts here
        for defence in config.defences:
            snapshots: list[dict[str, torch.Tensor]] = []

            def on_round(r: int, defence=defence) -> None:
                progress.advance(f"{kind} · {defence} · round {r}/{config.rounds}")

            def evaluate_and_keep(global_model: nn.Module, snapshots=snapshots) -> dict[str, float]:
                # Called before round 1 and after each round: snapshot r is the model round r+1 starts from.
                state = {n: p.detach().clone() for n, p in global_model.named_parameters()}
                snapshots.append(state)
                if initial and len(snapshots) == 1 and all(torch.equal(v, initial[0][0][n]) for n, v in state.items()):
                    return dict(initial[0][1])  # the same starting model: its utility is known
                scores = evaluate(global_model)
                if not initial:
                    initial.append((state, scores))
                return scores

            run = run_rounds(
                model, client_batches, rounds=config.rounds, defence=defence, optimizer=config.optimizer, lr=lr,
                eval_fn=evaluate_and_keep, on_round=on_round,
            )
            final = run.utility[-1] if run.utility else {}
            utility.append({"model": kind, "defence": defence, "rounds": config.rounds, **final,
                            "before": run.utility[0] if run.utility else {}, **_privacy_budget(run.reports)})
            rounds_log.append({"model": kind, "defence": defence, "rounds": run.rounds})
            for attack in config.attacks:
                fn = _attack_fn(attack)
                predictions, references, seconds = [], [], 0.0
                for r, shared in enumerate(run.captured[:attack_rounds]):
                    server_model = _server_copy(model, snapshots[r])
                    for sg in shared:
                        refs = _references(tokenizer, sg.batch)
                        t0 = time.time()
                        preds = fn(server_model, sg.grads, tokenizer, len(refs))
                        seconds += time.time() - t0
                        predictions.append(preds)
                        references.append(refs)
                        if r == 0 and sg.client == 0:
                            reconstructions += _reconstruction_rows(kind, defence, attack, refs, preds, tokenizer)
                        progress.advance(f"{kind} · {defence} · {attack}")
                scores = _mean_scores([_score(p, ref, tokenizer, kind) for p, ref in zip(predictions, references)])
                if attack not in null and defence == "none" and run.captured and run.captured[0]:
                    null[attack] = _null(fn, model, run.captured[0][0], tokenizer, kind)
                    progress.advance(f"{kind} · null · {attack}")
                results.append({"model": kind, "defence": defence, "attack": attack, **scores,
                                "null_rouge1": null.get(attack), "gradients": len(predictions), "seconds": round(seconds, 2)})
        for r in results:  # fill the null baseline in rows computed before it existed
            if r["model"] == kind and r["null_rouge1"] is None:
                r["null_rouge1"] = null.get(r["attack"])
    return {
        "meta": {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
                 "seconds": round(time.time() - started, 1), "torch": torch.__version__},
        "results": results,
        "utility": utility,
        "rounds": rounds_log,
        "reconstructions": reconstructions,
    }


def _server_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """The server's global model of that round (what the attacker knows)."""
    import copy

    server = copy.deepcopy(model)
    with torch.no_grad():
        params = dict(server.named_parameters())
        for name, value in state.items():
            params[name].copy_(value)
    return server.eval()


def _mean_scores(scores: list[dict[str, float]]) -> dict[str, float]:
    if not scores:
        return {k: 0.0 for k in ("rouge1", "rouge2", "rougeL", "token_recall", "exact_rate")}
    return {k: round(sum(s[k] for s in scores) / len(scores), 4) for k in scores[0]}


def _null(fn, model, shared, tokenizer, kind) -> float:
    """The same attack on a random gradient of matched per-tensor norms: the chance level."""
    from .. import metrics

    refs = _references(tokenizer, shared.batch)
    alignment = "greedy" if kind == "decoder" else "hungarian"
    return round(metrics.null_baseline(fn, model, shared.grads, tokenizer, len(refs), refs, alignment=alignment)["rouge1"], 4)


def _privacy_budget(reports: list[dict[str, float]]) -> dict[str, float]:
    eps = [r["epsilon"] for r in reports if "epsilon" in r]
    return {"epsilon": max(eps)} if eps else {}


def _reconstruction_rows(kind, defence, attack, refs, preds, tokenizer) -> list[dict]:
    """Each private sentence beside the reconstruction the metrics matched to it."""
    from .. import metrics

    rows = []
    for ref, j in zip(refs, metrics.align(preds, refs, "greedy" if kind == "decoder" else "hungarian")):
        pred = "" if j is None else preds[j]
        rows.append({"model": kind, "defence": defence, "attack": attack, "reference": ref, "prediction": pred,
                     "reference_tokens": tokenizer.tokenize(ref), "prediction_tokens": tokenizer.tokenize(pred)})
    return rows
