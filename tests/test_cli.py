"""`aegis inspect`: the coverage report, offline, on the embedded MiniLM, a model type and a local path."""
import re

import transformers as T
from typer.testing import CliRunner

from aegis.cli import app

runner = CliRunner()


def _summary(output: str) -> tuple[int, int, int, float]:
    text = " ".join(output.split())
    m = re.search(r"(\d+) parameters .*?(\d+) frozen, (\d+) flooded, (\d+) clean; share of parameters frozen: ([\d.]+)%", text)
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
    assert "embeddings.word_embeddings.weight" in result.output and "rows flood" in result.output
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
