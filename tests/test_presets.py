"""The presets, named for what they stop: their treatments, their promises, how the audit checks a promise
and how ``aegis calibrate`` picks a preset from them."""
import math

import pytest
from typer.testing import CliRunner

import aegis
from aegis.audit.options import ATTACKS, UsageError, resolve_defence
from aegis.audit.records import THREATS, AttackRecord, AuditReport, report_from_json, verdicts
from aegis.baselines import make_defence
from aegis.cli import app
from aegis.config import (
    RECONSTRUCTION_DELTA_SENTENCES,
    SENTENCES_BATCH,
    SENTENCES_SNR,
    VERIFICATION_MAX_BATCH,
    VERIFICATION_ROWS_SNR,
    AegisConfig,
    Calibration,
    Preset,
    Threat,
    Treatment,
)
from aegis.policy import plan
from aegis.utility.calibrate import recommend
from families import FAMILIES, build

ROWS_ROLES = ("token_embedding", "token_embedding_lora", "position_embedding", "lm_head", "head")
VOCABULARY_ROLES = ("token_embedding", "token_embedding_lora", "position_embedding", "lm_head")


# -- the enum and its names ------------------------------------------------------------------------------------------


def test_presets_are_one_enum_and_accept_their_values():
    assert [p.value for p in Preset] == ["verification", "sentences", "paper", "reconstruction-delta"]
    assert AegisConfig().preset is Preset.VERIFICATION  # the default stops the most
    for preset in Preset:
        assert AegisConfig(preset=preset.value).preset is preset
        assert f"aegis-{preset}" == f"aegis-{preset.value}"
        assert AegisConfig(preset=preset).treatments == dict(preset.treatments)


def test_the_utility_preset_is_gone_and_the_error_names_the_replacement():
    with pytest.raises(ValueError, match=r"preset='utility' was removed: it did not train; use 'sentences'"):
        AegisConfig(preset="utility")
    with pytest.raises(ValueError, match=r"preset='reconstruction' was removed: .*use 'reconstruction-delta'"):
        AegisConfig(preset="reconstruction")
    with pytest.raises(ValueError, match=r"preset='papr' is unknown: use one of \['verification'"):
        AegisConfig(preset="papr")
    with pytest.raises(ValueError, match="was removed"):
        make_defence("aegis-utility")
    assert make_defence("aegis").name == "aegis-verification"
    assert make_defence("aegis-sentences").name == "aegis-sentences"


# -- what each preset does -------------------------------------------------------------------------------------------


def test_paper_is_the_papers_formulas_as_written_and_says_so():
    with pytest.warns(UserWarning, match="reproduces the paper's formulas"):
        config = AegisConfig(preset="paper")
    t = config.treatments
    for role in ROWS_ROLES:
        assert (t[role].kind, t[role].lam, t[role].rho, t[role].snr) == ("rows", 1.0, 0.3, math.inf), role
    assert (t["mlp"].kind, t["mlp"].lam, t["mlp"].rho) == ("matrix", 8.0, 0.0)
    for role in ("norm", "bias"):
        assert (t[role].kind, t[role].lam, t[role].rho) == ("matrix", 4.0, 0.0), role
    assert t["attention"].kind == "frozen"
    promise = Preset.PAPER.promise
    assert not promise.stops and not promise.trains
    assert "candidate verification reads 1.00" in promise.says and "241 / 228" in promise.cost


def test_verification_caps_every_rows_flood_and_does_not_train():
    t = AegisConfig(preset="verification").treatments
    for role in ROWS_ROLES:
        assert t[role].kind == "rows" and t[role].snr == VERIFICATION_ROWS_SNR, role
    assert all(t[role].rho == 0.0 for role in ("mlp", "norm", "bias", "other"))  # pure noise
    promise = Preset.VERIFICATION.promise
    assert promise.stops == set(Threat) and not promise.trains
    assert "does not train" in promise.says and "secure aggregation" in promise.says
    assert promise.max_batch == VERIFICATION_MAX_BATCH and AegisConfig(preset="verification").exposures == 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sentences_exports_no_vocabulary_indexed_tensor(family):
    """Every family: the token embedding (and a head tied to it), LoRA factors of it, an untied LM head or
    vocabulary bias and the position embedding are frozen (their rows would show the bag of words); only a
    classifier's label rows are a rows flood, at the verification cap; the rest floods at SENTENCES_SNR."""
    plans = plan(build(family), AegisConfig(preset="sentences"))
    for p in plans:
        if p.role in (*VOCABULARY_ROLES, "attention"):
            assert p.treatment.kind == "frozen", p.name
        elif p.role == "head":
            assert p.treatment.kind == "rows" and p.treatment.snr == VERIFICATION_ROWS_SNR, p.name
        else:
            assert (p.treatment.kind, p.treatment.rho, p.treatment.snr) == ("matrix", 1.0, SENTENCES_SNR), p.name
    assert any(p.treatment.kind == "matrix" for p in plans)  # something trains


def test_sentences_promise_says_the_bag_of_words_and_verification_are_not_stopped():
    promise = Preset.SENTENCES.promise
    assert promise.stops == {Threat.SENTENCES} and promise.trains
    assert "NOT the bag of words" in promise.says and "verify them" in promise.says
    assert Preset.VERIFICATION.promise.stops == set(Threat) and not Preset.PAPER.promise.stops
    assert promise.min_batch == SENTENCES_BATCH >= 8 and promise.max_batch is None
    assert promise.outside(SENTENCES_BATCH) is None
    assert "below the batch" in promise.outside(SENTENCES_BATCH - 1)
    assert "above the batch" in Preset.VERIFICATION.promise.outside(VERIFICATION_MAX_BATCH + 1)


def test_a_promise_holds_only_for_the_configuration_it_was_made_for():
    base = AegisConfig(preset="sentences")
    assert base.promise is Preset.SENTENCES.promise
    assert base.replace(overrides={"mlp": Treatment("frozen")}).promise is None
    assert base.replace(allow_clean=("transformer.ln_f.weight",)).promise is None
    assert base.replace(calibration=Calibration.BATCH).promise is None  # its noise level fingerprints the batch
    assert base.replace(exposure_budget=base.exposures + 1).promise is None
    assert base.replace(exposure_budget=1).promise is Preset.SENTENCES.promise
    assert AegisConfig(preset=dict(Preset.VERIFICATION.treatments)).promise is None
    assert resolve_defence("aegis-verification").promise is Preset.VERIFICATION.promise
    assert resolve_defence("aegis-paper-batch").promise is None and resolve_defence("prune-90").promise is None


# -- the audit's verdict ---------------------------------------------------------------------------------------------


def _record(attack: str, leaks: bool, defence: str = "aegis-x") -> AttackRecord:
    if THREATS[attack] is Threat.VERIFICATION:  # 1-of-40 with its rank-sum p-value
        score, p = (1.0, 1e-9) if leaks else (0.025, 0.5)
        return AttackRecord("decoder", defence, attack, "accuracy", score, 1 / 40, 40, 1.0, p_value=p)
    score = 0.95 if leaks else 0.02
    return AttackRecord("decoder", defence, attack, "rouge1", score, 0.02, 4, 1.0, rouge1=score, token_recall=score,
                        null_token_recall=0.02)


def test_every_attack_measures_a_threat():
    assert set(THREATS) == set(ATTACKS)


def test_verdict_states_and_checks_the_promise():
    promise = Preset.SENTENCES.promise
    verification_leaks = [_record("dager", False), _record("fingerprint_secret", True)]
    kept = verdicts(verification_leaks, "decoder", "aegis-x", "public", promise, SENTENCES_BATCH)
    assert not kept.holds and kept.promise_kept is True and kept.breaking == []
    assert kept.text().startswith(f"{promise.says} — promise kept at batch {SENTENCES_BATCH}. leaks: ")
    assert kept.text().endswith(", as stated")

    text_leaks = [_record("dager", True), _record("fingerprint_secret", True)]
    broken = verdicts(text_leaks, "decoder", "aegis-x", "public", promise, SENTENCES_BATCH)
    assert broken.promise_kept is False and broken.breaking == [_record("dager", True).headline()]
    assert "promise broken by dager ROUGE-1 0.95" in broken.text() and "as stated" not in broken.text()

    small = verdicts(text_leaks, "decoder", "aegis-x", "public", promise, 2)
    assert small.promise_kept is None and small.breaking == []
    assert f"promise not checked (batch 2 is below the batch {SENTENCES_BATCH}" in small.text()

    strict = verdicts(verification_leaks, "decoder", "aegis-x", "public", Preset.VERIFICATION.promise, 4)
    assert strict.promise_kept is False and "fingerprint_secret" in strict.breaking[0]
    paper = verdicts(text_leaks, "decoder", "aegis-x", "public", Preset.PAPER.promise, 4)
    assert paper.promise_kept is None and "promises nothing" in paper.text()
    baseline = verdicts(text_leaks, "decoder", "aegis-x")
    assert baseline.promise is None and baseline.text().startswith("leaks: ")

    html = kept.render(lambda kind, s: f"<{kind}>{s}</{kind}>", lambda s: s.replace(";", "&#59;"))
    assert "<holds>promise kept</holds>" in html and "<leak>leaks</leak>" in html and "&#59;" in html
    again = report_from_json(AuditReport({}, verdicts=[kept, broken, small]).to_json()).verdicts
    assert [v.text() for v in again] == [kept.text(), broken.text(), small.text()]


# -- aegis calibrate -------------------------------------------------------------------------------------------------


def test_recommend_picks_from_the_promises():
    rebuilt = recommend("sentences", SENTENCES_BATCH)
    assert rebuilt.preset is Preset.SENTENCES and Preset.SENTENCES.promise.cost in " ".join(rebuilt.why)
    # below the sentences promise's batch, the preset that also stops verification is what covers it,
    # and the recommendation says what training would need
    small = recommend(Threat.SENTENCES, SENTENCES_BATCH - 1)
    assert small.preset is Preset.VERIFICATION
    assert any(f"below the batch {SENTENCES_BATCH}" in line for line in small.why)
    # reconstruction as a whole: the delta-mode preset trains and stops it from 8 sentences a round; below
    # that only verification covers it, and the recommendation names what training would need
    whole = recommend("reconstruction", RECONSTRUCTION_DELTA_SENTENCES)
    assert whole.preset is Preset.RECONSTRUCTION_DELTA and Preset.RECONSTRUCTION_DELTA.promise.cost in whole.why[1]
    assert whole.why[0].startswith("reconstruction-delta: delta mode")
    fewer = recommend("reconstruction", RECONSTRUCTION_DELTA_SENTENCES - 1)
    assert fewer.preset is Preset.VERIFICATION
    assert any(line.startswith("reconstruction-delta would stop it, but batch 7 is below") for line in fewer.why)
    assert any("No preset that trains stops reconstruction; sentences trains" in line for line in fewer.why)
    assert recommend("verification", 1).preset is Preset.VERIFICATION
    assert recommend("verification", VERIFICATION_MAX_BATCH + 1).preset is None
    too_often = recommend("verification", 4, exposures=Preset.VERIFICATION.promise.exposures + 1)
    assert too_often.preset is None and "export(s) per example" in too_often.why[0]
    assert all(recommend(t, b).preset is not Preset.PAPER for t in Threat for b in (1, 8, 64))
    with pytest.raises(UsageError, match="--threat"):
        recommend("inversion", 8)
    with pytest.raises(UsageError, match="--batch-size"):
        recommend("verification", 0)


def test_calibrate_command_recommends_without_training():
    runner = CliRunner()
    out = runner.invoke(app, ["calibrate", "--threat", "sentences", "--batch-size", str(SENTENCES_BATCH)],
                        env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "use preset sentences" in out.output and "stops sentence reconstruction (the words in order" in out.output
    out = runner.invoke(app, ["calibrate", "--threat", "verification", "--batch-size", "4", "--model", "gpt2"],
                        env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "use preset verification" in out.output and "on gpt2: " in out.output and " 0 clean" in out.output
    for args, option in (([], "--threat"), (["--threat", "reconstruction"], "--batch-size"),
                         (["--threat", "everything", "--batch-size", "8"], "--threat")):
        out = runner.invoke(app, ["calibrate", *args])
        assert out.exit_code == 2 and f"error: {option}" in out.output, out.output


def test_inspect_says_the_promise():
    out = CliRunner().invoke(app, ["inspect", "gpt2", "--preset", "sentences", "--summary-only"],
                             env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    assert f"preset sentences: {Preset.SENTENCES.promise.says}" in out.output
    out = CliRunner().invoke(app, ["inspect", "gpt2", "--preset", "utility"])
    assert out.exit_code == 2 and "was removed" in out.output


def test_package_exports_the_concepts():
    assert aegis.Preset is Preset and aegis.Threat is Threat and aegis.Promise is type(Preset.PAPER.promise)
