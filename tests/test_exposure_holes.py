"""The exposure budget cannot be walked around: retries of a refused step, restarts, near-duplicate text,
embeddings fed without ids, and the reason a Flower client gives the server."""
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aegis
from aegis import ExposurePolicy
from aegis.exposure import IN_MEMORY, WINDOW, create_state, default_state_path
from families import build

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")

BOS, EOS, PAD = 1, 2, 0
TEXT = torch.arange(10, 10 + 3 * WINDOW)  # 24 tokens of content
OTHER, FRESH = TEXT + 30, TEXT + 60  # unrelated texts (the vocabulary has 96 ids)
SHORT = torch.tensor([3, 4, 5, 6, 7, 8])  # a sentence shorter than one window


def protected(budget=1, state=IN_MEMORY, policy=ExposurePolicy.REFUSE, family="gpt2", optimizer=False):
    model = build(family)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2) if optimizer else None
    config = aegis.AegisConfig(seed=3, exposure_budget=budget, exposure=policy, exposure_state=state)
    return model, opt, aegis.protect(model, opt, config=config)


def rows(*seqs, pad=PAD):
    """Right-padded ids and attention mask of the given sequences."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for k, s in enumerate(seqs):
        ids[k, : len(s)], mask[k, : len(s)] = s, 1
    return ids, mask


def backward(model, ids, mask=None):
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()


def export(model, shield, ids, mask=None):
    model.zero_grad(set_to_none=True)
    backward(model, ids, mask)
    shield.mask_()
    return shield.export()


def wrap(seq):
    return torch.cat([torch.tensor([BOS]), seq, torch.tensor([EOS])])


# -- a refused step stays refused ---------------------------------------------------------------------
def test_a_refused_step_stays_refused_however_it_is_retried():
    model, opt, shield = protected(optimizer=True)
    ids, mask = rows(wrap(TEXT))
    export(model, shield, ids, mask)
    opt.zero_grad(set_to_none=True)
    backward(model, ids, mask)
    with pytest.raises(RuntimeError, match="exposure budget"):
        shield.mask_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    retries = [
        shield.mask_,
        shield.ensure_masked,
        opt.step,  # the optimizer hook masks
        lambda: (backward(model, ids, mask), shield.mask_()),  # a second backward of the same batch
        lambda: (opt.zero_grad(set_to_none=False), shield.mask_()),  # zeroed in place, no forward
        lambda: (opt.zero_grad(set_to_none=True), shield.mask_()),  # dropped, no forward
    ]
    for retry in retries:
        with pytest.raises(RuntimeError, match="exposure budget"):
            retry()
        with pytest.raises(RuntimeError, match="export\\(\\) refused"):
            shield.export()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert shield.report().max_exposure == 1
    # dropping the gradients and running a fresh batch works, with either zero_grad
    for k, set_to_none in enumerate((False, True)):
        opt.zero_grad(set_to_none=set_to_none)
        backward(model, *rows(wrap((OTHER, FRESH)[k])))
        opt.step()
        assert shield.export()


# -- persistence --------------------------------------------------------------------------------------
def test_counts_persist_in_the_named_file_across_shields_and_processes(tmp_path):
    path = tmp_path / "client-7.sqlite"
    with pytest.raises(FileNotFoundError, match="create_state"):
        protected(state=str(path))
    create_state(path)
    with pytest.raises(FileExistsError):
        create_state(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    ids, mask = rows(wrap(TEXT))
    script = (
        "import sys, torch, aegis; sys.path.insert(0, 'tests'); from families import build; "
        "m = build('gpt2'); s = aegis.protect(m, config=aegis.AegisConfig(exposure_budget=1, "
        f"exposure_state={str(path)!r})); ids = torch.tensor({ids.tolist()}); mask = torch.tensor({mask.tolist()}); "
        "m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward(); s.mask_(); s.export()"
    )
    root = os.path.dirname(os.path.dirname(__file__))
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    model, _, shield = protected(state=str(path))  # the restarted client
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, ids, mask)
    # a fresh example is exported and written to the file for the next process
    export(model, shield, *rows(wrap(OTHER)))
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT sum(length(digests)) / 8 FROM log").fetchone()[0] == 2 * (3 * WINDOW - WINDOW + 1)


def test_the_default_state_lives_in_the_cache_folder_and_survives_a_new_shield():
    assert str(default_state_path()).startswith(os.environ["AEGIS_CACHE_DIR"])
    ids, mask = rows(wrap(TEXT))
    model, _, shield = protected(state=None)
    export(model, shield, ids, mask)
    shield.remove()
    model, _, shield = protected(state=None)
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, ids, mask)


def test_a_corrupt_or_replaced_state_is_an_error_not_a_reset(tmp_path):
    path = create_state(tmp_path / "s.sqlite")
    model, _, shield = protected(state=str(path))
    Path(f"{path}-wal").unlink(missing_ok=True)
    path.write_bytes(b"not a database " * 400)
    with pytest.raises(ValueError, match="corrupt"):
        protected(state=str(path))
    with pytest.raises(ValueError, match="corrupt"):
        export(model, shield, *rows(wrap(TEXT)))
    path.unlink()
    create_state(path)  # another state with another salt under the same name
    with pytest.raises(RuntimeError, match="replaced"):
        export(model, shield, *rows(wrap(OTHER)))


# -- near duplicates ----------------------------------------------------------------------------------
def _variants():
    other = OTHER
    return {
        "without its EOS": rows(torch.cat([torch.tensor([BOS]), TEXT])),
        "truncated by one token": rows(wrap(TEXT[:-1])),
        "cut by many tokens": rows(wrap(TEXT[5:5 + WINDOW + 2])),
        "inside a sliding window": rows(TEXT[3:3 + 2 * WINDOW]),
        "packed with another example": rows(torch.cat([wrap(other), wrap(TEXT)])),
        "left padded": (torch.cat([torch.full((1, 4), PAD), wrap(TEXT)[None]], 1),
                        torch.cat([torch.zeros(1, 4), torch.ones(1, len(TEXT) + 2)], 1).long()),
        "in a batch with others": rows(wrap(other), wrap(TEXT)),
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_near_duplicates_count_as_the_same_text(variant):
    model, _, shield = protected()
    export(model, shield, *rows(wrap(TEXT)))
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, *_variants()[variant])


@pytest.mark.parametrize("cut", ["first", "last", "eos"])
def test_a_short_sentence_cut_by_one_token_is_the_same_text(cut):
    model, _, shield = protected()
    export(model, shield, *rows(wrap(SHORT)))
    seq = {"first": wrap(SHORT[1:]), "last": wrap(SHORT[:-1]), "eos": torch.cat([torch.tensor([BOS]), SHORT])}[cut]
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, *rows(seq))


def test_padding_with_eos_and_no_pad_id_is_stripped_by_the_attention_mask():
    model, _, shield = protected()
    model.config.pad_token_id = None
    export(model, shield, *rows(wrap(TEXT), pad=EOS))
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, *rows(wrap(TEXT), wrap(torch.cat([TEXT, TEXT[:3]])), pad=EOS))


def test_unrelated_text_is_not_counted():
    model, _, shield = protected()
    export(model, shield, *rows(wrap(TEXT)))
    export(model, shield, *rows(wrap(OTHER), wrap(SHORT + 1)))
    assert shield.report().max_exposure == 1


def test_inputs_embeds_are_refused_unless_the_ids_are_given():
    model, _, shield = protected()
    ids, mask = rows(wrap(TEXT))
    export(model, shield, ids, mask)
    embeds = model.get_input_embeddings()(ids)
    model.zero_grad(set_to_none=True)
    model(inputs_embeds=embeds.detach(), attention_mask=mask, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="track_examples"):
        shield.mask_()
    shield.track_examples(ids, mask)
    with pytest.raises(RuntimeError, match="exposure budget"):
        shield.mask_()
    ids, mask = rows(wrap(FRESH))
    model.zero_grad(set_to_none=True)
    model(inputs_embeds=model.get_input_embeddings()(ids).detach(), attention_mask=mask, labels=ids).loss.backward()
    shield.track_examples(ids, mask)
    shield.mask_()
    assert shield.export()


# -- what the server learns from a refusal ------------------------------------------------------------
def test_the_flower_mod_replies_with_a_constant_error():
    pytest.importorskip("flwr")
    from flwr.app import Context, Message, MessageType, RecordDict

    from aegis.fl import flower_runtime
    from aegis.fl.client import REFUSAL, AegisMod

    mod = AegisMod()
    with flower_runtime():
        msg = Message(RecordDict(), 1, MessageType.TRAIN)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reasons = set()
    for over in (1, 3):
        def train(msg, context, over=over):
            raise RuntimeError(f"mask_() refused: {over} example(s) of this batch hold text already exported")

        reply = mod(msg, context, train)
        assert reply.has_error()
        reasons.add((reply.error.code, reply.error.reason))
    assert len(reasons) == 1 and next(iter(reasons))[1] == REFUSAL
    assert not any(ch.isdigit() for ch in REFUSAL)
