"""One calibration table: the fingerprint attack rebuilds exactly the table the shield floods with."""
import pytest
import torch

import aegis
from aegis.attacks.fingerprint import FingerprintAttack
from aegis.calibration import COLUMNS, public_table, synthetic_loss
from aegis.config import PRESETS, Preset, Treatment
from families import build

CUSTOM = {**PRESETS[Preset.VERIFICATION], "mlp": Treatment("matrix", lam=2.0, rho=0.5, clip=1.5, snr=40.0),
          "token_embedding": Treatment("rows", lam=0.5, rho=1.0, snr=3.0)}


@pytest.mark.parametrize("preset", [p for p in Preset if p is not Preset.RECONSTRUCTION_DELTA] + ["custom"], ids=str)
@pytest.mark.parametrize("family", ["gpt2", "bert-causal"])
def test_the_attack_table_equals_the_shield_table(preset, family):
    config = aegis.AegisConfig(preset=CUSTOM if preset == "custom" else preset)
    model = build(family)
    loss = synthetic_loss(model)
    attack = FingerprintAttack(model, config, calibration_loss=loss)
    shield = aegis.protect(model, config=config, calibration_loss=loss)
    shield.calibrate()
    assert [t.name for t in attack.tensors] == [p.name for p in shield._flooded]
    assert [t.mode for t in attack.tensors] == [p.flood_mode for p in shield._flooded]
    assert torch.equal(attack._public_table(), shield._params.cpu())
    table = public_table(shield._flooded, loss, config.rel_threshold)
    assert table.names == tuple(shield.public_params()) and torch.equal(table.values, shield._params)
    assert torch.equal(table.column("sigma"), table.values[:, COLUMNS.index("sigma")])
