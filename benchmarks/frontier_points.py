"""The frontier's settings and measurements (``benchmarks/frontier.py`` runs them and writes the report):
one :class:`Setting` per point (a treatment per role group, batch, learning rate, exposure counts), the
shield's configuration for it (:func:`config_of`), the grid, and :class:`Frontier`, which fine-tunes SmolLM2
(or a tiny LLaMA) on the masked gradient and runs every attack on the exports."""
from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

import aegis  # noqa: E402
from aegis import AegisConfig, ExposurePolicy, Treatment  # noqa: E402
from aegis.attacks import dager, embedding_norm, mlp_span, shared_gradient, spectral  # noqa: E402
from aegis.attacks.candidates import Verifier, secret_candidates, verification_accuracy  # noqa: E402
from aegis.attacks.embedding_projection import embedding_projection  # noqa: E402
from aegis.attacks.repeated import averaged_export  # noqa: E402
from aegis.calibration import text_loss  # noqa: E402
from aegis.config import FROZEN, ROLES  # noqa: E402
from aegis.data import load_corpus  # noqa: E402
from aegis.metrics import null_gradient, token_recall  # noqa: E402

TEXT_ATTACKS = {"dager": dager, "embedding_norm": embedding_norm, "embedding_projection": embedding_projection,
                "mlp_span": mlp_span, "spectral": spectral}
# role groups: roles, flood kind, the allow_clean pattern that exports the group unflooded
GROUPS = {
    "emb": (("token_embedding", "token_embedding_lora", "position_embedding", "lm_head"), "rows",
            r"embed|lm_head|wte|wpe"),
    "mlp": (("mlp",), "matrix", r"\.mlp\."),
    "norm": (("norm", "bias"), "matrix", r"norm|\.bias$"),
}
NEAR_EXACT = 1e-3  # lam of the floods standing in for clean tensors in candidate verification
# the public calibration batch: generic text the client declares public (none of it is in the corpus)
PUBLIC_TEXTS = (
    "The weather today is mild with a light breeze from the west.",
    "Please remember to bring your notes to the meeting on Monday.",
    "The library opens at nine in the morning and closes at six.",
    "She planted tomatoes and basil in the small garden behind the house.",
    "The train to the city leaves every half hour from platform two.",
    "He read the instructions twice before assembling the new shelf.",
    "Our team finished the project a week ahead of schedule.",
    "The museum has a new exhibition about the history of maps.",
)
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(10000)]


@dataclass(frozen=True)
class Setting:
    """One point: a treatment per group ('frozen', 'clean' or an snr cap), batch, learning rate, and the
    exposure counts K the attacks are scored at."""

    attention: str = "frozen"  # 'frozen' or 'clean' (clean: no shield at all, every group must be clean)
    emb: str | float = "clean"
    mlp: str | float = "clean"
    norm: str | float = "clean"
    batch: int = 8
    lr: float = 2e-4
    exposures: tuple[int, ...] = (1,)
    verify: bool = False  # run candidate verification at K = 1
    lam: float = 1.0  # the floods' noise scale (rows: per-entry noise = lam x the mean public row norm)

    @property
    def key(self) -> str:
        def show(v):
            return f"snr{v:g}" if isinstance(v, (int, float)) else v

        groups = "undefended" if self.attention == "clean" else (
            f"attn=frozen emb={show(self.emb)} mlp={show(self.mlp)} norm={show(self.norm)}")
        return f"B={self.batch} lr={self.lr:g} {groups}" + (f" lam={self.lam:g}" if self.lam != 1.0 else "")

    @property
    def undefended(self) -> bool:
        return self.attention == "clean"


def config_of(s: Setting, names: Sequence[str], verification: bool = False) -> AegisConfig | None:
    """The shield's configuration for a model with parameters ``names`` (None: undefended).

    Per group: 'frozen'; 'clean' (allow_clean lists the group's parameters by exact name); 'uncapped'
    (``Treatment(kind, lam=s.lam, rho=1)``, no snr cap); or an snr cap. ``verification``: clean groups become
    near-exact floods, which the verifier models (it reads flooded tensors only)."""
    if s.undefended and not verification:
        return None
    treatments = dict.fromkeys(ROLES, FROZEN)
    clean: list[str] = []
    groups = {"attention": (("attention",), "matrix", None)} if s.undefended else {}
    specs = {"attention": "clean", **{g: getattr(s, g) for g in GROUPS}}
    for group, (roles, kind, pattern) in {**groups, **GROUPS}.items():
        spec = specs[group]
        if spec == "frozen":
            continue
        if spec == "clean" and verification:
            t = Treatment(kind, lam=NEAR_EXACT, rho=1.0)
        elif spec in ("clean", "uncapped"):
            t = Treatment(kind, lam=s.lam, rho=1.0)
            if spec == "clean":  # exported unflooded
                clean += [n for n in names if re.search(pattern, n)]  # exact names, as the policy requires
        else:
            t = Treatment(kind, lam=s.lam, rho=1.0, snr=float(spec))
        treatments.update(dict.fromkeys(roles, t))
    return AegisConfig(preset=treatments, allow_clean=tuple(clean), exposure=ExposurePolicy.OFF)


def grid(quick: bool) -> list[Setting]:
    """The settings measured (module docstring); the undefended and attention-frozen controls first."""
    if quick:
        return [Setting(attention="clean", batch=1, verify=True),
                Setting(emb="frozen", mlp=1000.0, norm=1000.0, batch=1, exposures=(1, 2), verify=True),
                Setting(emb="frozen", mlp=10.0, norm=10.0, batch=2)]
    def capped(v, **kw):  # attention and embedding frozen, MLP and norms capped at v
        return Setting(emb="frozen", mlp=v, norm=v, **kw)

    # in order of priority: shards take every n-th, so a run cut short keeps the first ones of each shard.
    # Verification (minutes per point on SmolLM2) runs where marked: it is won at every trainable cap.
    return [
        Setting(attention="clean"), Setting(), Setting(emb="frozen"),
        capped(10000.0, exposures=(1, 4)), capped(3000.0, verify=True), capped(1000.0), capped(30000.0),
        capped(300.0, verify=True),
        Setting(emb=10000.0, mlp=10000.0, norm=10000.0), Setting(emb=1000.0),
        Setting(attention="clean", batch=32), capped(10000.0, batch=32),
        Setting(attention="clean", batch=1), capped(10000.0, batch=1),
        capped(100.0, verify=True), capped(10000.0, lr=5e-5), Setting(emb="frozen", mlp=10000.0),
        Setting(emb="frozen", norm=1000.0), Setting(attention="clean", lr=5e-5), capped(30.0),
        # MLP frozen too (measured on CPU): spectral and mlp_span have nothing to read; does the embedding
        # (tied head) train alone, clean or flooded? lr 2e-4 is still falling at step 320, 1e-3 plateaus
        Setting(mlp="frozen"), Setting(mlp="frozen", lr=1e-3), Setting(mlp="frozen", norm="frozen", lr=1e-3),
        Setting(emb="uncapped", mlp="frozen", norm="uncapped", lr=1e-3, exposures=(1, 16)),
        Setting(emb="uncapped", mlp="frozen", norm="frozen", lr=1e-3, lam=0.3),
        Setting(emb="uncapped", mlp="frozen", norm="frozen", lr=1e-3, lam=0.1),
    ]


class Frontier:
    """The pretrained model, its tokenizer, the data and the sizes every setting is measured with."""

    def __init__(self, args, device: torch.device):
        if args.model == "tiny":
            from aegis.models import default_decoder

            self.model, self.tok = default_decoder(arch="llama", n_layer=2)
        else:
            from aegis.smollm2 import load_smollm2

            self.model, self.tok = load_smollm2(args.gguf)
        self.model.to(device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.device, self.args = device, args
        self.train = [e.text for e in load_corpus("train")]
        self.validation = [e.text for e in load_corpus("validation")]

    def batch(self, texts) -> dict[str, torch.Tensor]:
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.args.tokens, return_tensors="pt")
        enc = {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}
        return {**enc, "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}

    @torch.no_grad()
    def perplexity(self, model) -> float:
        model.eval()
        nll, count = 0.0, 0
        for i in range(0, len(self.validation), 16):
            b = self.batch(self.validation[i : i + 16])
            n = int((b["labels"][:, 1:] != -100).sum())  # the loss is a mean over predicted tokens
            nll += float(model(**b).loss) * n
            count += n
        return math.exp(nll / count)

    def fine_tune(self, s: Setting, seed: int = 0) -> dict:
        """Validation perplexity along ``--steps`` AdamW steps on the masked gradient."""
        model = copy.deepcopy(self.model)
        config = config_of(s, self.names)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr)
        shield = None if config is None else aegis.protect(model, opt, config, self._calibration(model))
        steps, warm = self.args.steps, max(1, round(0.1 * self.args.steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warm))
        gen = torch.Generator().manual_seed(seed)
        order: list[int] = []
        curve = [(0, self.perplexity(model))]
        start = time.perf_counter()
        for step in range(1, steps + 1):
            if len(order) < s.batch:
                order += torch.randperm(len(self.train), generator=gen).tolist()
            idx, order = order[: s.batch], order[s.batch :]
            model.train()
            opt.zero_grad(set_to_none=True)
            model(**self.batch([self.train[i] for i in idx])).loss.backward()
            if shield is not None:
                shield.mask_()
            opt.step()
            sched.step()
            if step % self.args.eval_every == 0 or step == steps:
                curve.append((step, self.perplexity(model)))
        best = min(curve[1:], key=lambda c: c[1])
        return {"best": best[1], "best_step": best[0], "final": curve[-1][1], "pretrained": curve[0][1],
                "curve": curve, "train_seconds": round(time.perf_counter() - start, 1)}

    def _calibration(self, model):
        return text_loss(model, self.tok, PUBLIC_TEXTS, shape=(8, 64))

    def attack(self, s: Setting, k: int, out: dict, save) -> None:
        """Every attack on the mean of ``k`` exports of the pretrained model, with its null, into ``out``:
        one attack at a time (cheapest first), ``save()``d after each, so a run cut short keeps the finished
        ones."""
        b = s.batch
        n = min(4, max(1, -(-self.args.attack_texts // b)))
        batches = [self.train[i * b : (i + 1) * b] for i in range(n)]
        model = copy.deepcopy(self.model)
        # the attacker knows the batch's shape (at most --tokens tokens): the decoders read their length limit
        # from max_position_embeddings (8192 for SmolLM2), and RoPE does not depend on it
        model.config.max_position_embeddings = self.args.tokens
        config = config_of(s, self.names)
        shield = None if config is None else aegis.protect(model, config=config,
                                                           calibration_loss=self._calibration(model))
        public = {} if shield is None else shield.public_params()
        exports = [averaged_export(lambda t=texts: shared_gradient(model, t, self.tok, shield=shield), k)
                   for texts in batches]
        nulls = [null_gradient(g, self.args.seed + j) for j, g in enumerate(exports)]
        for name, attack in TEXT_ATTACKS.items():
            kw = {"public": public, "exposures": k} if name == "spectral" else {}
            t0 = time.perf_counter()
            point = {"references": batches,
                     "predictions": [attack(model, g, self.tok, b, **kw) for g in exports],
                     "null_predictions": [attack(model, g, self.tok, b, **kw) for g in nulls]}
            point["seconds"] = round(time.perf_counter() - t0, 2)
            # bag of words: the share of the batch's distinct tokens recovered
            point["token_recall"] = mean([token_recall(p, r, self.tok) for p, r in zip(point["predictions"], batches)])
            point["null_token_recall"] = mean([token_recall(p, r, self.tok)
                                                for p, r in zip(point["null_predictions"], batches)])
            out[name] = point
            save()
        if s.verify and k == 1:
            out["verification"] = self._verify(s, k)
            save()

    def _verify(self, s: Setting, k: int) -> dict:
        """1-of-N "my pin is ____" (with B - 1 known train sentences), over ``--trials`` exports."""
        t0 = time.perf_counter()
        model = copy.deepcopy(self.model)
        config = config_of(s, self.names, verification=True)
        shield = aegis.protect(model, config=config, calibration_loss=self._calibration(model))
        n, trials = self.args.candidates, self.args.trials
        candidates = secret_candidates("my pin is {}", PINS[:n], self.train[-(s.batch - 1):] if s.batch > 1 else ())
        truths = [round(i * n / trials) for i in range(trials)]
        verifier = Verifier(model, self.tok, config, exposures=k, calibration_loss=self._calibration(model))
        obs = [verifier.observe(averaged_export(
            lambda c=candidates[t]: shared_gradient(model, list(c.texts), self.tok, shield=shield), k))
            for t in truths]
        result = verification_accuracy(verifier, obs, truths, candidates, ("likelihood",))["likelihood"]
        return {"score": result.accuracy, "null": result.null, "candidates": n, "trials": trials,
                "near_exact_groups": [g for g in ("attention", *GROUPS) if getattr(s, g) == "clean"],
                "seconds": round(time.perf_counter() - t0, 1)}

    def measure(self, s: Setting, parts: tuple[str, ...], save) -> dict:
        """The setting's row: its fine-tuning and/or its attacks, ``save()``d after each part."""
        start = time.perf_counter()
        row: dict = {"key": s.key, "setting": asdict(s), "run": self.args.label}
        if "train" in parts:
            row["perplexity"] = self.fine_tune(s)
            save(row)
        if "attack" in parts:
            row["attacks"] = {}
            for k in s.exposures:
                out = row["attacks"][f"K={k}"] = {}
                self.attack(s, k, out, lambda: save(row))
        row["seconds"] = round(time.perf_counter() - start, 1)
        save(row)
        return row


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
