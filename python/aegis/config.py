"""Configuration as plain data: treatments per role, presets, and AegisConfig (DESIGN §1.4, §3)."""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from .exposure import IN_MEMORY, ExposurePolicy

ROLES = (
    "attention",
    "token_embedding",
    "token_embedding_lora",
    "position_embedding",
    "lm_head",
    "mlp",
    "norm",
    "bias",
    "head",
    "other",
    "mlp_lora",
    "attention_lora",
)
# peft LoRA factors (A and B) of an MLP or attention projection: a mapping without an entry for one of these
# roles gives it the treatment of the module it adapts (attention adapters stay frozen unless opted in).
LORA_ROLE_PARENT = MappingProxyType({"mlp_lora": "mlp", "attention_lora": "attention"})


class ExportMode(str, enum.Enum):
    """What leaves the client.

    STEP:  every optimizer step's gradient, flooded (``aegis.shield.Shield``): the paper's setting.
    DELTA: one flooded weight delta per round of local training (``aegis.delta.DeltaShield``, FedAvg);
           the local steps themselves are never exported.
    """

    STEP = "step"
    DELTA = "delta"

class NonFinite(str, enum.Enum):
    """What a step whose gradient holds a NaN or inf does. Its flooded tensors are NaN wherever the input was
    non-finite, so nothing of it can leave either way.

    STEP: ``mask_()`` does not wait for the GPU to find out (the default: no device sync per step, as PyTorch
          itself never checks); ``export()`` refuses the step, naming the tensors, and the optimizer steps as
          it would without AEGIS (``torch.amp.GradScaler`` skips inf steps before the shield's hook).
    SKIP: ``mask_()`` waits for the flood's norms (one device sync per step) and drops every gradient, so the
          optimizer step changes nothing; ``export()`` refuses; a warning names the tensors.
    """

    STEP = "step"
    SKIP = "skip"


Kind = Literal["frozen", "rows", "matrix"]

FIXED_KEY_ENV = "AEGIS_ALLOW_FIXED_KEY"  # tests only: lets AegisConfig(seed=...) through


class Calibration(str, enum.Enum):
    """Where each tensor's noise level sigma (and clip bound) comes from.

    PUBLIC: the gradient of a public calibration batch (``protect(..., calibration_loss=...)``, or
            synthetic tokens), refreshed every ``refresh_every`` steps; the private gradient is
            clipped to a bound from the same public statistic. What leaves the client depends on
            the private batch only through rho * clip(G).
    BATCH:  the paper's calibration on the private gradient itself (sigma = lam * m_bar(G)). Its
            noise level is readable from any large tensor and fingerprints the batch: for
            reproducing the paper only; ``report()`` and ``inspect`` flag it as leaking.
    """

    PUBLIC = "public"
    BATCH = "batch"


@dataclass(frozen=True)
class Treatment:
    """What happens to a parameter's gradient: frozen (never exported) or flooded (rows / matrix)."""

    kind: Kind
    lam: float = 0.0
    rho: float = 1.0
    clip: float = 2.0  # public calibration: private norms clipped to clip x the public batch's largest
    # public calibration: rho is lowered where needed so that rho * clip / sigma <= snr, the signal one
    # row (rows) or the tensor (matrix) can export over the per-entry noise (inf: no cap)
    snr: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("frozen", "rows", "matrix"):
            raise ValueError(f"Treatment kind={self.kind!r}: use 'frozen', 'rows' or 'matrix'")
        if self.kind != "frozen" and (self.lam < 0 or self.rho < 0 or not self.clip > 0 or not self.snr >= 0):
            raise ValueError(f"Treatment lam={self.lam}, rho={self.rho}, clip={self.clip}, snr={self.snr}: "
                             "lam, rho, snr >= 0 and clip > 0")

    def describe(self) -> str:
        return "frozen" if self.kind == "frozen" else f"{self.kind} flood"


FROZEN = Treatment("frozen")

# What an attacker reads. A server holding the model computes any candidate batch's gradient and
# correlates it with the export (candidate verification: aegis.attacks.fingerprint "likelihood"). Its
# signal-to-noise ratio is rho * clip / sigma per row (rows floods) or per tensor (matrix floods), a
# public constant under the public calibration, capped by ``Treatment.snr`` and shown as ``ReportRow.snr``.
# K exports of one batch average to snr * sqrt(K) (``Promise.exposures`` bounds K).
#
# Measured on an H100 with the real cipher (benchmarks/results/verification-h100.json, 1-of-40, 40
# trials, decoder / LLaMA / encoder, B = 1 and 4): rows snr 0.2 -> up to 0.20 (sentence), 0.1 -> up to
# 0.125, 0.05 -> at most 0.075 (the bar 1/40 + 0.05), 0.025 -> at most 0.025; label attack on the
# 4-class head at snr 0.05: 0.21 / 0.31 / 0.31 at B = 1 / 2 / 8 (nulls 0.25 / 0.39 / 0.66). The paper's
# rows rho = 0.3 uncapped is snr ~ 3 per token row: 1.00.


class Threat(str, enum.Enum):
    """What a server holding the exports tries; each preset is named for the one it stops.

    SENTENCES:      recover a training sentence, its words in order (DAGER, mlp_span, TAG).
    RECONSTRUCTION: recover anything of the private text: its sentences, its bag of words, or its labels
                    (also embedding_norm, spectral, the label attack). Stopping it stops SENTENCES.
    VERIFICATION:   holding candidate texts, tell which one an export was computed on (1-of-N fingerprint,
                    secret completion "my pin is ____", the loss oracle). Stopping it stops reconstruction.
    """

    SENTENCES = "sentences"
    RECONSTRUCTION = "reconstruction"
    VERIFICATION = "verification"

    def __str__(self) -> str:
        return self.value

    @property
    def words(self) -> str:
        return {Threat.SENTENCES: "sentence reconstruction", Threat.RECONSTRUCTION: "reconstruction",
                Threat.VERIFICATION: "candidate verification"}[self]


class Preset(str, enum.Enum):
    """The shipped presets, named for what they stop (``Preset.X.promise`` says what, where and at what cost)."""

    VERIFICATION = "verification"
    SENTENCES = "sentences"
    PAPER = "paper"
    RECONSTRUCTION_DELTA = "reconstruction-delta"

    def __str__(self) -> str:
        return self.value

    @property
    def treatments(self) -> Mapping[str, Treatment]:
        return PRESETS[self]

    @property
    def promise(self) -> Promise:
        return PROMISES[self]


@dataclass(frozen=True)
class Promise:
    """What a preset stops, where, and what it costs: plain data the audit checks and ``aegis calibrate`` reads.

    stops:      the threats held at their null (an attack more than 0.05 above its null breaks the promise).
    says:       the promise in words, as the audit's verdict states it.
    trains:     whether a model fine-tuned on one client's exports learns (measured, see cost).
    cost:       what it costs in utility, measured.
    exposures:  exports per example it covers: the default exposure budget (noise averages as sqrt(K)).
    min_batch, max_batch: the batch sizes (sequences per export) it is stated for (None: no upper bound).
    """

    stops: frozenset[Threat]
    says: str
    trains: bool
    cost: str
    exposures: int
    min_batch: int = 1
    max_batch: int | None = None
    export: ExportMode = ExportMode.STEP  # DELTA: the batch sizes are sentences per round

    def outside(self, batch_size: int) -> str | None:
        """Why the promise does not cover this batch size, or None when it does."""
        if batch_size < self.min_batch:
            return f"batch {batch_size} is below the batch {self.min_batch} it is stated for"
        if self.max_batch is not None and batch_size > self.max_batch:
            return f"batch {batch_size} is above the batch {self.max_batch} it is stated for"
        return None


# `verification`: every rows flood capped at snr 0.02 (0.04 over its 4 exports), MLP, norms and biases
# flooded with rho = 0 (pure noise). Measured: the figures above and DESIGN §1.4 (B = 1, 4, 8).
VERIFICATION_ROWS_SNR = 0.02
VERIFICATION_EXPOSURES = 4
VERIFICATION_MAX_BATCH = 8  # at B = 8, K = 4 (snr 0.04) verification sits at the bar (DESIGN §1.4)
_VERIFICATION_ROWS = Treatment("rows", lam=1.0, rho=0.3, snr=VERIFICATION_ROWS_SNR)
VERIFICATION: Mapping[str, Treatment] = MappingProxyType(
    {
        "attention": FROZEN,
        "token_embedding": _VERIFICATION_ROWS,
        # LoRA factors indexed by token id: rows flood along the token axis (ParamPlan.rows_axis); the
        # other factor of the pair (not token-indexed) gets a matrix flood at the embedding's strength
        "token_embedding_lora": _VERIFICATION_ROWS,
        "position_embedding": _VERIFICATION_ROWS,
        "lm_head": _VERIFICATION_ROWS,
        "mlp": Treatment("matrix", lam=8.0, rho=0.0),
        "norm": Treatment("matrix", lam=4.0, rho=0.0),
        "bias": Treatment("matrix", lam=4.0, rho=0.0),
        "head": _VERIFICATION_ROWS,  # rows = labels (policy rule 10)
        "other": Treatment("matrix", lam=4.0, rho=0.0),  # strict=False only: pure noise, never signal
        "mlp_lora": Treatment("matrix", lam=8.0, rho=0.0),
        "attention_lora": FROZEN,
    }
)

# `sentences`: trains, and stops the attacks that recover a sentence in order. A vocabulary-indexed
# gradient shows which rows the batch used (the bag of words), so every such tensor is frozen: the token
# embedding (and a head tied to it), its LoRA factors, an untied LM head (its rows are the next tokens)
# and the position embedding. The classifier head keeps the verification cap (its rows are the labels).
# Every other tensor is a matrix flood at a signal of SENTENCES_SNR times the per-entry noise: an MLP
# matrix (~10^6 entries) trains from it. Measured on SmolLM2-135M at B = 8, one export (NVIDIA H200,
# benchmarks/results/frontier-h200-smollm2.json): DAGER, mlp_span and embedding_norm at their nulls, but
# `spectral` recovers 31 % of a batch's distinct tokens (ROUGE-1 0.14; 10 % at snr 300) and candidate
# verification reads 1.00, so it does not stop reconstruction as a whole.
SENTENCES_SNR = 1000.0
SENTENCES_BATCH = 8
SENTENCES_EXPOSURES = 1
_SENTENCES_FLOOD = Treatment("matrix", lam=1.0, rho=1.0, snr=SENTENCES_SNR)
SENTENCES: Mapping[str, Treatment] = MappingProxyType(
    {
        "attention": FROZEN,
        "token_embedding": FROZEN,
        "token_embedding_lora": FROZEN,
        "position_embedding": FROZEN,
        "lm_head": FROZEN,
        "mlp": _SENTENCES_FLOOD,
        "norm": _SENTENCES_FLOOD,
        "bias": _SENTENCES_FLOOD,
        "head": _VERIFICATION_ROWS,
        "other": _SENTENCES_FLOOD,
        "mlp_lora": _SENTENCES_FLOOD,
        "attention_lora": FROZEN,
    }
)

# `paper`: the paper's formulas as written, to reproduce it: rows floods rho 0.3 lam 1 with no snr cap
# (snr ~ 3 per token row), MLP rho 0 lam 8, norms and biases rho 0 lam 4.
_PAPER_ROWS = Treatment("rows", lam=1.0, rho=0.3)
PAPER: Mapping[str, Treatment] = MappingProxyType(
    {
        **VERIFICATION,
        **dict.fromkeys(("token_embedding", "token_embedding_lora", "position_embedding", "lm_head", "head"),
                        _PAPER_ROWS),
    }
)

# `reconstruction-delta` (ExportMode.DELTA): attention, every vocabulary-indexed tensor and attention
# adapters frozen; MLP adapters (or MLP matrices), norms and biases exported once per round as
# clip(delta) + sigma Z at a per-tensor cap S = RECONSTRUCTION_DELTA_S (sigma = clip / S, from the public
# round). S = 300: every reconstruction attack at its null on one SmolLM2 client's delta at D = 8 and 32
# (benchmarks/frontier_delta.py, docs/results.md: spectral 0.02-0.03 at D = 8, null 0.00), and the mean of
# 100 such deltas costs under 0.1 % perplexity.
RECONSTRUCTION_DELTA_S = 300.0
RECONSTRUCTION_DELTA_SENTENCES = 8  # sentences per round it is stated for (D >= 8)
_DELTA_FLOOD = Treatment("matrix", lam=0.0, rho=1.0, snr=RECONSTRUCTION_DELTA_S)
RECONSTRUCTION_DELTA: Mapping[str, Treatment] = MappingProxyType(
    {
        **SENTENCES,
        **dict.fromkeys(("mlp", "mlp_lora", "norm", "bias", "other"), _DELTA_FLOOD),
    }
)

PRESETS: Mapping[Preset, Mapping[str, Treatment]] = MappingProxyType(
    {Preset.VERIFICATION: VERIFICATION, Preset.SENTENCES: SENTENCES, Preset.PAPER: PAPER,
     Preset.RECONSTRUCTION_DELTA: RECONSTRUCTION_DELTA}
)

# Measured costs: SmolLM2-135M-Instruct fine-tuned on the shipped corpus (batch 8, 64 tokens, AdamW,
# 320 steps, exposure budget off; pretrained perplexity 260.5, undefended 5.74 at lr 5e-5, 4.47 at 2e-4).
PROMISES: Mapping[Preset, Promise] = MappingProxyType(
    {
        Preset.VERIFICATION: Promise(
            stops=frozenset(Threat),
            says="stops candidate verification and reconstruction; does not train a model from one client's "
            "exports (secure aggregation, where the server sees only a sum over clients, is the way out)",
            trains=False,
            cost="does not train: SmolLM2 validation perplexity 259 after fine-tuning (pretrained 261, "
            "undefended 5.7)",
            exposures=VERIFICATION_EXPOSURES,
            max_batch=VERIFICATION_MAX_BATCH,
        ),
        Preset.SENTENCES: Promise(
            stops=frozenset({Threat.SENTENCES}),
            says="stops sentence reconstruction (the words in order; measured on SmolLM2 at batch 8, one export); "
            "NOT the bag of words: the "
            "spectral attack recovers about a third of a batch's distinct tokens, and a server with candidate "
            "texts can verify them",
            trains=True,
            cost=f"trains: SmolLM2 validation perplexity 6.75 at snr {SENTENCES_SNR:g}, 1.48x undefended (4.56), "
            "in 320 steps at batch 8 with the exposure budget off (8 epochs); within its budget of one export "
            "per example a client trains one epoch",
            exposures=SENTENCES_EXPOSURES,
            min_batch=SENTENCES_BATCH,
        ),
        Preset.PAPER: Promise(
            stops=frozenset(),
            says="the paper's formulas as written, for reproduction: candidate verification reads 1.00 "
            "(uncapped rows rho 0.3) and it does not train",
            trains=False,
            cost="does not train: SmolLM2 validation perplexity 241 / 228 at lr 5e-5 / 2e-4 (pretrained 261, "
            "undefended 5.7 / 4.5)",
            exposures=1,
        ),
        Preset.RECONSTRUCTION_DELTA: Promise(
            # benchmarks/frontier_delta.py on SmolLM2 (frontier-delta-{h200,cpu}-smollm2.json)
            stops=frozenset({Threat.SENTENCES, Threat.RECONSTRUCTION}),
            says=f"delta mode (one flooded delta per round of local training, cap S = {RECONSTRUCTION_DELTA_S:g} "
            "per tensor): stops sentence reconstruction and the bag of words at "
            f"{RECONSTRUCTION_DELTA_SENTENCES} sentences or more per round (measured on SmolLM2: DAGER, mlp_span, "
            "spectral and the embedding readers at their nulls on one client's delta at 8 and 32 sentences, full "
            "MLP or LoRA trained with AdamW, and one SGD step at 8; a classifier head's label channel in delta mode "
            "is not measured); NOT candidate verification: a server holding candidate datasets identifies one "
            "client's delta",
            trains=True,
            cost="trains: the mean of 100 clients' flooded deltas (one round of 32 sentences each) reaches SmolLM2 "
            "perplexity 45.92 with LoRA r = 8 on the MLP (undefended LoRA 45.92, undefended full fine-tune 45.26, "
            "pretrained 76.4) and 39.16 with the full MLP (undefended 39.11)",
            exposures=1,
            min_batch=RECONSTRUCTION_DELTA_SENTENCES,
            export=ExportMode.DELTA,
        ),
    }
)

REMOVED_PRESETS = {
    "utility": "it did not train; use 'sentences' (trains, stops sentence reconstruction only) or "
               "'verification' (stops reconstruction and candidate verification, does not train)",
    "reconstruction": "no per-step setting both trains and stops reconstruction (the bag of words leaks "
                      "where training works); use 'reconstruction-delta' (one flooded delta per round: trains and "
                      "stops reconstruction), 'sentences' (per step: trains, stops sentence reconstruction only) or "
                      "'verification' (stops reconstruction, does not train)",
}


def preset_from(name: str | Preset) -> Preset:
    """A Preset from its value, with an error that names the choices (and the replacement of a removed one)."""
    if isinstance(name, Preset):
        return name
    if name in REMOVED_PRESETS:
        raise ValueError(f"preset={name!r} was removed: {REMOVED_PRESETS[name]}")
    try:
        return Preset(name)
    except ValueError:
        raise ValueError(f"preset={name!r} is unknown: use one of {[p.value for p in Preset]} or a role -> "
                         "Treatment mapping") from None


@dataclass(frozen=True)
class AegisConfig:
    """Everything ``aegis.protect`` needs.

    preset:         a Preset (or its value: "verification", "sentences", "paper") or a role -> Treatment
                    mapping. Each Preset carries its promise (``Preset.X.promise``): what it stops, at which
                    batch size and exposure budget, and what it costs.
    overrides:      role -> Treatment replacing the preset's entry for that role.
    role_overrides: regex on parameter names -> role, checked before detection (first match wins).
    allow_clean:    regexes matching WHOLE parameter names exported UNFLOODED; explicit opt-out, shown in the
                    report. A token- or label-indexed parameter (embedding, LM head, vocabulary bias,
                    classifier) must be listed by its exact name, and warns.
    allow_outside_promise: export steps whose batch size lies outside the preset's promise
                    (``Promise.min_batch`` / ``max_batch``); False (default): such a step is refused
                    (:meth:`outside_promise` says why, :meth:`check_batch` raises).
    strict:         raise (default) when a trainable parameter's role is unknown; False gives it the
                    'other' flood with a warning.
    rel_threshold:  tau of the rows flood (rows with norm > tau x the calibration's max norm carry signal).
    calibration:    Calibration.PUBLIC (default) or Calibration.BATCH (the paper's; leaks the flood level).
    refresh_every:  public calibration: recompute the public statistics every this many steps.
    seed:           a fixed key, for tests only: refused unless the environment sets
                    AEGIS_ALLOW_FIXED_KEY=1 (a known key lets anyone remove the noise). None (default)
                    draws a fresh 256-bit key from ``secrets`` for every step.
    exposure_budget: how many masked exports may carry one example (token sequence); None: the preset's
                    promise (``Promise.exposures``), 1 for a custom preset.
    exposure:       ExposurePolicy.REFUSE (default: ``mask_()`` raises past the budget), SILENCE (that
                    step exports pure noise) or OFF (no tracking: the guarantee covers one export).
    exposure_state: the file the exposure counts persist in across runs and restarts (see
                    ``aegis.exposure``): None (default) is ``default.sqlite`` under the user's cache folder
                    (``$AEGIS_CACHE_DIR`` or ``~/.cache/aegis/exposure``), created on first use; a named
                    file must exist (``aegis.exposure.create_state``); ``aegis.exposure.IN_MEMORY`` keeps
                    the counts for the shield's lifetime only (simulations).
    device_seed:    keep a master key on the gradients' device and derive each step's key there through
                    the cipher, so a captured CUDA graph of ``mask_()`` draws a fresh key on every replay
                    (the master key is redrawn in a forked child).
    cuda_graph:     on CUDA (default True), capture the flood and its checksum once as a CUDA graph that
                    reads the gradients' addresses from a device table, and replay it on every later step
                    (one launch instead of ~12, whether ``zero_grad`` moves the gradients or not).
                    Gradients no table can address (short embedding rows, mixed dtypes, non-contiguous)
                    are flooded eagerly, as with False.
    non_finite:     NonFinite.STEP (default: a step with a NaN or inf gradient is refused at ``export()``, and
                    ``mask_()`` never waits for the GPU) or SKIP (``mask_()`` syncs once per step and drops such
                    a step's gradients, so the optimizer step is a no-op).
    export:         ExportMode.STEP (default: every step's gradient is flooded and exported) or DELTA (one
                    flooded weight delta per round of local training, calibrated by a public round:
                    ``aegis.delta``).
    """

    preset: Preset | str | Mapping[str, Treatment] = Preset.VERIFICATION
    overrides: Mapping[str, Treatment] = field(default_factory=dict)
    role_overrides: Mapping[str, str] = field(default_factory=dict)
    allow_clean: tuple[str, ...] = ()
    allow_outside_promise: bool = False
    strict: bool = True
    rel_threshold: float = 0.01
    calibration: Calibration = Calibration.PUBLIC
    refresh_every: int = 100
    seed: int | None = None
    exposure_budget: int | None = None
    exposure: ExposurePolicy = ExposurePolicy.REFUSE
    exposure_state: str | None = None
    device_seed: bool = False
    cuda_graph: bool = True
    non_finite: NonFinite = NonFinite.STEP
    export: ExportMode = ExportMode.STEP

    def __post_init__(self) -> None:
        if isinstance(self.preset, str):
            object.__setattr__(self, "preset", preset_from(self.preset))
        if isinstance(self.preset, Preset) and self.preset.promise.export is ExportMode.DELTA:
            object.__setattr__(self, "export", ExportMode.DELTA)  # the preset is defined in delta mode only
        if self.preset is Preset.PAPER:
            warnings.warn("preset 'paper' reproduces the paper's formulas: candidate verification reads 1.00 and it "
                          "does not train; to protect, use 'verification' or 'sentences'", stacklevel=3)
        for role in (*self.overrides, *self.role_overrides.values()):
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in overrides/role_overrides: roles are {ROLES}")
        if not 0.0 <= self.rel_threshold < 1.0:
            raise ValueError(f"rel_threshold={self.rel_threshold}: must lie in [0, 1)")
        object.__setattr__(self, "calibration", Calibration(self.calibration))
        object.__setattr__(self, "exposure", ExposurePolicy(self.exposure))
        if self.non_finite not in tuple(NonFinite):
            raise ValueError(f"non_finite={self.non_finite!r}: use NonFinite.STEP or NonFinite.SKIP ('step' / 'skip')")
        object.__setattr__(self, "non_finite", NonFinite(self.non_finite))
        if self.export not in tuple(ExportMode):
            raise ValueError(f"export={self.export!r}: use ExportMode.STEP or ExportMode.DELTA ('step' / 'delta')")
        object.__setattr__(self, "export", ExportMode(self.export))
        if self.exposure_budget is not None and self.exposure_budget < 1:
            raise ValueError(f"exposure_budget={self.exposure_budget}: must be >= 1 (exports per example), or "
                             "None for the preset's")
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every={self.refresh_every}: must be >= 1 (steps between public calibrations)")
        if self.seed is not None:
            if os.environ.get(FIXED_KEY_ENV) != "1":
                raise ValueError(
                    f"seed={self.seed}: a fixed key lets anyone who knows it subtract the noise. Leave seed=None "
                    f"(a fresh secret key per step); tests may set {FIXED_KEY_ENV}=1 to allow it"
                )
            if not 0 <= self.seed < 2**256:
                raise ValueError(f"seed={self.seed}: a fixed key must lie in [0, 2**256)")
            warnings.warn(f"AegisConfig(seed={self.seed}): FIXED noise key (tests only); this noise is not secret",
                          stacklevel=3)

    @property
    def treatments(self) -> dict[str, Treatment]:
        preset = preset_from(self.preset) if isinstance(self.preset, str) else self.preset  # a Preset already
        base = PRESETS[preset] if isinstance(preset, Preset) else preset
        merged = {**base, **self.overrides}
        for role, parent in LORA_ROLE_PARENT.items():
            if role not in merged and parent in merged:
                merged[role] = merged[parent]
        missing = set(ROLES) - set(merged)
        if missing:
            raise ValueError(f"preset has no treatment for roles {sorted(missing)}")
        return merged

    @property
    def exposures(self) -> int:
        """The exposure budget in force (the preset's promise unless set)."""
        if self.exposure_budget is not None:
            return self.exposure_budget
        return self.preset.promise.exposures if isinstance(self.preset, Preset) else 1

    @property
    def promise(self) -> Promise | None:
        """The preset's promise; None for a custom mapping, overrides or allow_clean (not the configuration
        measured), the batch calibration (its noise level fingerprints the batch) or a larger exposure budget."""
        if (not isinstance(self.preset, Preset) or self.overrides or self.allow_clean
                or self.calibration is not Calibration.PUBLIC or self.exposures > self.preset.promise.exposures
                or self.export is not self.preset.promise.export):
            return None
        return self.preset.promise

    def outside_promise(self, batch_size: int) -> str | None:
        """Why a step of ``batch_size`` sequences lies outside this configuration's promise, or None: inside
        it, or no promise to keep (:attr:`promise` is None). Whatever ``allow_outside_promise`` says."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: a step's batch holds an integer >= 1 of sequences")
        promise = self.promise
        why = None if promise is None else promise.outside(batch_size)
        return None if why is None else f"preset {str(self.preset)!r}: {why}"

    def check_batch(self, batch_size: int) -> None:
        """Raise ValueError, naming the batch, the promise and the fix, when a step of ``batch_size``
        sequences lies outside the promise and ``allow_outside_promise`` is False."""
        why = self.outside_promise(batch_size)
        if why is not None and not self.allow_outside_promise:
            raise ValueError(f"batch_size={batch_size}: {why}; use a batch size the promise covers, another preset, "
                             "or AegisConfig(allow_outside_promise=True) to export outside it")

    def replace(self, **changes) -> AegisConfig:
        if "preset" in changes:
            return dataclasses.replace(self, **changes)
        with warnings.catch_warnings():  # the preset's warning was given when this configuration was made
            warnings.filterwarnings("ignore", message="preset 'paper'")
            return dataclasses.replace(self, **changes)


def simulated_client(config: AegisConfig) -> AegisConfig:
    """The configuration a simulated client runs (in process, on Flower's simulation runtime, in the audit):
    its exposure counts in memory for the run (``aegis.exposure.IN_MEMORY``), so that one simulation does not
    inherit the counts of the last; a configuration that names its state file keeps it."""
    return config if config.exposure_state is not None else config.replace(exposure_state=IN_MEMORY)
