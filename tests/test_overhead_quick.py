"""CI exercises benchmarks/overhead.py --quick (timing targets live in the GPU results, not here)."""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "overhead.py"


def test_quick_overhead_run_reports_every_defence(tmp_path):
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    overhead = importlib.util.module_from_spec(spec)
    sys.modules["overhead"] = overhead  # dataclasses resolve their module by name
    spec.loader.exec_module(overhead)
    out = overhead.main(["--quick", "--out", str(tmp_path)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["defence"] for r in rows] == list(overhead.DEFENCES)
    assert all("error" not in r for r in rows), rows
    by_name = {r["defence"]: r for r in rows}
    # AEGIS shares no attention gradient: its payload is the non-attention share of the model.
    assert by_name["aegis-verification"]["payload_ratio"] < 1.0
    assert all(r["median_s"] > 0 for r in rows)
