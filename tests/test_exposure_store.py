"""The exposure store: one transaction per export, no race between shields or processes, every forward
counted, a refused step refused until dropped, and a store that cannot be planted, rolled back or silently
restarted."""
import json
import logging
import multiprocessing as mp
import os
import sqlite3
import sys

import pytest
import torch

import aegis
from aegis import ExposurePolicy
from aegis.exposure import IN_MEMORY, WINDOW, create_state, default_state_path
from aegis.exposure_store import ExposureStore, digest_key, migrate, reset_state
from families import build
from test_exposure_holes import backward, export

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")

TEXT = torch.arange(10, 10 + 3 * WINDOW)[None]  # one sentence of 24 tokens (the vocabulary has 96 ids)
OTHER, FRESH = TEXT + 30, TEXT + 60
TESTS = os.path.dirname(__file__)


def protected(state, budget=1, optimizer=False, policy=ExposurePolicy.REFUSE):
    model = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2) if optimizer else None
    config = aegis.AegisConfig(seed=3, exposure_budget=budget, exposure=policy, exposure_state=state)
    return model, opt, aegis.protect(model, opt, config=config)


# -- two shields, two processes, one store --------------------------------------------------------------
def test_two_shields_in_one_process_share_the_budget(tmp_path):
    """B loads, A exports, B exports: B reads the store inside its own decision, not a copy from its start."""
    path = create_state(tmp_path / "client.sqlite")
    model_a, _, shield_a = protected(str(path))
    model_b, _, shield_b = protected(str(path))
    export(model_a, shield_a, TEXT)
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model_b, shield_b, TEXT)


def _racer(path, barrier, results):
    sys.path.insert(0, TESTS)
    os.environ["AEGIS_ALLOW_FIXED_KEY"] = "1"
    torch.set_num_threads(1)
    from families import build as build_model

    model = build_model("gpt2")
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure_budget=1, exposure_state=path))
    model(input_ids=TEXT, labels=TEXT).loss.backward()
    barrier.wait()  # both hold the same pending sentence; both decide now
    try:
        shield.mask_()
        shield.export()
        results.put("exported")
    except RuntimeError as err:
        results.put("refused" if "exposure budget" in str(err) else f"error: {err}")


def test_two_processes_at_a_barrier_export_a_sentence_once_in_total(tmp_path):
    path = str(create_state(tmp_path / "client.sqlite"))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(path, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["exported", "refused"]


# -- what counts -------------------------------------------------------------------------------------
def test_two_forwards_before_one_backward_count_both():
    """A pair loss: the first forward is an exposure too, though no gradient existed when the second began."""
    model, _, shield = protected(IN_MEMORY)
    loss = model(input_ids=TEXT, labels=TEXT).loss + model(input_ids=OTHER, labels=OTHER).loss
    loss.backward()
    shield.mask_()
    for text in (TEXT, OTHER):
        with pytest.raises(RuntimeError, match="exposure budget"):
            export(model, shield, text)
        model.zero_grad(set_to_none=True)


def test_rows_with_an_all_zero_mask_count_by_their_ids():
    model, _, shield = protected(IN_MEMORY)
    mask = torch.zeros_like(TEXT)
    export(model, shield, TEXT, mask)
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, TEXT, torch.ones_like(TEXT))


def test_an_in_place_touch_after_a_refusal_keeps_the_step_refused():
    model, opt, shield = protected(IN_MEMORY, optimizer=True)
    export(model, shield, TEXT)
    model.zero_grad(set_to_none=True)
    backward(model, TEXT)
    with pytest.raises(RuntimeError, match="exposure budget"):
        shield.mask_()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # changes the gradients in place: not a drop
    backward(model, FRESH)  # a fresh batch on top: the refused text is still in the gradient
    with pytest.raises(RuntimeError, match="exposure budget"):
        shield.mask_()
    with pytest.raises(RuntimeError, match="exposure budget"):
        opt.step()
    opt.zero_grad(set_to_none=False)  # zeroed: the refused examples are gone
    backward(model, FRESH)
    shield.mask_()
    assert shield.export()


def test_a_direct_forward_with_embeddings_is_refused():
    """model.forward() runs past the module hooks: a gradient with no counted forward is refused."""
    model, _, shield = protected(IN_MEMORY)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(TEXT)
    model.forward(inputs_embeds=embeds, labels=TEXT).loss.backward()
    with pytest.raises(RuntimeError, match="track_examples"):
        shield.mask_()
    shield.track_examples(TEXT)
    shield.mask_()
    assert shield.export()


def test_refusals_name_the_store_and_this_process_share(tmp_path):
    path = create_state(tmp_path / "client.sqlite")
    model, _, shield = protected(str(path))
    export(model, shield, TEXT)
    with pytest.raises(RuntimeError, match=rf"counted in {path} \(1 export\(s\) of it by this process\)"):
        export(model, shield, TEXT)


# -- the store fails closed ---------------------------------------------------------------------------
def test_a_deleted_default_store_is_recreated_with_a_warning(caplog):
    path = default_state_path()
    assert path.suffix == ".sqlite" and str(path).startswith(os.environ["AEGIS_CACHE_DIR"])
    with caplog.at_level(logging.WARNING, logger="aegis.exposure"):
        model, _, shield = protected(None)
    assert f"created a new exposure store at {path}: no earlier counts" in caplog.text
    export(model, shield, TEXT)
    shield.remove()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aegis.exposure"):
        protected(None)
    assert "no earlier counts" not in caplog.text  # it exists now: loaded, not restarted


def test_a_relative_cache_folder_is_refused(monkeypatch):
    monkeypatch.setenv("AEGIS_CACHE_DIR", "relative/cache")
    with pytest.raises(ValueError, match="AEGIS_CACHE_DIR.*absolute"):
        protected(None)


@pytest.mark.parametrize("plant", ["group-writable", "world-writable-folder", "symlink"])
def test_a_planted_store_is_refused(tmp_path, plant):
    path = create_state(tmp_path / "real" / "client.sqlite")
    named = path
    if plant == "group-writable":
        path.chmod(0o660)
    elif plant == "world-writable-folder":
        path.parent.chmod(0o777)
    else:
        named = tmp_path / "link.sqlite"
        named.symlink_to(path)
    with pytest.raises(PermissionError, match="exposure (store|folder)"):
        protected(str(named))


def test_a_store_rolled_back_under_a_live_shield_is_an_error(tmp_path):
    path = create_state(tmp_path / "client.sqlite")
    snapshot = sqlite3.connect(":memory:")
    with sqlite3.connect(path) as db:
        db.backup(snapshot)  # the store before the export
    model, _, shield = protected(str(path))
    export(model, shield, TEXT)
    with sqlite3.connect(path) as db:
        snapshot.backup(db)  # restored in place: the export is forgotten
    with pytest.raises(RuntimeError, match="rolled back"):
        export(model, shield, OTHER)


def test_a_json_state_names_the_conversion_and_migrate_keeps_the_counts(tmp_path):
    store = ExposureStore(str(create_state(tmp_path / "old.sqlite")))
    legacy = tmp_path / "old.json"
    digest = bytes(range(16))
    key = digest_key(digest)
    legacy.write_text(json.dumps({"format": "aegis-exposure", "version": 1, "window": 8, "salt": store.salt.hex(),
                                  "counts": {digest.hex(): 2}}))
    with pytest.raises(ValueError, match="migrate"):
        protected(str(legacy))
    converted = ExposureStore(str(migrate(legacy, tmp_path / "new.sqlite")))
    assert converted.salt == store.salt and converted.count(key) == 2
    assert converted.reserve([{key}], budget=2) == 1 and converted.reserve([{key}], budget=3) == 0


def test_reserve_is_all_or_nothing_and_reset_forgets(tmp_path):
    path = create_state(tmp_path / "client.sqlite")
    store = ExposureStore(str(path))
    a, b, c = -(2**63), 7, 2**63 - 1
    assert store.reserve([{a, b}], budget=1) == 0
    assert store.reserve([{c}, {b}], budget=1) == 1  # one row over: nothing of the step is counted
    assert store.count(c) == 0 and store.count(b) == 1
    summary = store.summary()
    assert (summary.windows, summary.max_count, summary.exports) == (2, 1, 1)
    reset_state(path)
    fresh = ExposureStore(str(path))
    assert fresh.salt != store.salt and fresh.summary().windows == 0


# -- one client over several processes ---------------------------------------------------------------
def _rank(rank, rendezvous, path, results):
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from families import build as build_model

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model("gpt2")
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure_budget=1, exposure_state=path))
    ddp = DistributedDataParallel(model)
    outcomes = []
    for batch in ([TEXT, OTHER], [OTHER, FRESH]):  # rank 1 exports OTHER first; rank 0 brings it back
        model.zero_grad(set_to_none=True)
        ddp(input_ids=batch[rank], labels=batch[rank]).loss.backward()
        try:
            shield.mask_()
            outcomes.append(sum(float(t.double().sum()) for t in shield.export().values()))
        except RuntimeError as err:
            outcomes.append("refused" if "exposure budget" in str(err) else f"error: {err}")
    results.put((rank, outcomes))
    dist.destroy_process_group()


def test_ddp_ranks_count_across_ranks_and_flood_alike(tmp_path):
    path = str(create_state(tmp_path / "client.sqlite"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "rendezvous"), path, results)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    first0, second0 = outcomes[0]
    first1, second1 = outcomes[1]
    assert isinstance(first0, float) and first0 == first1  # one key: the replicas stay equal
    assert second0 == second1 == "refused"  # OTHER left through rank 1; rank 0's copy of it is refused


def test_the_write_ahead_log_stays_bounded(tmp_path):
    """Many exports of many windows: the WAL is checkpointed into the file, never grows with the history."""
    from aegis.exposure_store import CHECKPOINT_PAGES

    path = create_state(tmp_path / "client.sqlite")
    store = ExposureStore(str(path))
    rng = torch.Generator().manual_seed(0)
    per_export = 2000
    for _ in range(40):
        keys = torch.randint(-(2**62), 2**62, (per_export,), generator=rng).tolist()
        assert store.reserve([set(keys)], budget=1) == 0
    store.wait_durable()
    wal = os.path.getsize(f"{path}-wal")
    assert store.summary().windows == 40 * per_export
    assert wal <= (CHECKPOINT_PAGES + per_export + 64) * 4096 * 1.1, wal
