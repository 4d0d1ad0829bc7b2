"""`aegis inspect`: the coverage report, offline, on the embedded MiniLM, a model type and a local path."""
import re

import transformers as T
from typer.testing import CliRunner

from aegis.cli import app

runner = CliRunner()


def _summary(output: str) -> tuple[int, int, int, float]:
    text = " ".join(output.split())
    m = re.search(
        r"(\d+) parameters .*?(\d+) frozen, (\d+) flooded, (\d+) clean; share of parameters frozen: ([\d.]+)%", text
    )
    assert m, output
    total, frozen, flooded, clean, share = m.groups()
    assert int(clean) == 0
    return int(total), int(frozen), int(flooded), float(share)


def test_inspect_embedded_minilm_lists_every_parameter():
    result = runner.invoke(app, ["inspect"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    total, frozen, flooded, share = _summary(result.output)
    # MiniLM-L6: 6 layers x (Q,K,V,O weights + biases) = 48 frozen attention tensors.
    assert (total, frozen, frozen + flooded) == (103, 48, 103)
    assert "encoder.layer.0.attention.self.query.weight" in result.output
    assert "embeddings.word_embeddings.weight" in result.output
    assert re.search(r"embeddings\.word_embeddings\.weight\s+token_embedding\s+rows λ", result.output)
    assert 10 < share < 30


def test_inspect_model_type_and_local_path(tmp_path):
    result = runner.invoke(app, ["inspect", "llama", "--summary-only"])
    assert result.exit_code == 0, result.output
    total, frozen, flooded, share = _summary(result.output)
    assert frozen == 4 * 32 and total == frozen + flooded  # q, k, v, o in each of 32 blocks
    T.GPT2Config(n_layer=3, n_embd=32, n_head=2).save_pretrained(tmp_path)
    result = runner.invoke(app, ["inspect", str(tmp_path), "--summary-only"])
    assert result.exit_code == 0, result.output
    assert _summary(result.output)[1] == 3 * 4  # c_attn and c_proj weights and biases per block


def test_inspect_unknown_model_fails_with_the_fix():
    result = runner.invoke(app, ["inspect", "./no/such/dir-or-model"])
    assert result.exit_code == 2
    assert "local directory with config.json" in " ".join(result.output.split())


def test_inspect_takes_the_audits_models_and_fits_80_columns():
    """`aegis inspect decoder|decoder-random|encoder` are the audit's own models (frozen: every attention
    tensor); every row fits 80 columns, no name cut."""
    for name, frozen in (("decoder", 6 * 8), ("decoder-random", 4 * 4), ("encoder", 48)):
        result = runner.invoke(app, ["inspect", name], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert max(len(line) for line in result.output.splitlines()) <= 80
        assert "…" not in result.output
        assert _summary(result.output)[1] == frozen
    # a folded name still reads whole when the fold is undone
    joined = "".join(line.split()[0] if line.strip() else "" for line in result.output.splitlines())
    assert "encoder.layer.5.attention.self.query.weight" in joined


def test_help_lists_the_choices_at_80_columns():
    from aegis.audit.options import ATTACKS, DEFENCES

    result = runner.invoke(app, ["audit", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = "".join(result.output.split())
    for name in (*DEFENCES, *ATTACKS, "decoder", "encoder", "decoder-random"):
        assert name in text, name
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_inspect_bad_option_is_one_line():
    result = runner.invoke(app, ["inspect", "decoder", "--preset", "nope"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "--preset" in result.stderr and "paper" in result.stderr
