"""The README's quick start runs offline as written, and the model visibly trains."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_start_runs_twice_with_the_defaults(tmp_path):
    """The first run trains (its loss falls) and skips the batches it is refused; the second, on the same counts,
    is refused every batch and still ends normally."""
    code = re.search(r"## Quick start.*?```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AEGIS_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for out in runs:
        assert out.returncode == 0, out.stderr[-2000:]
    first, second = runs
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", first.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, first.stdout
    refused, steps = map(int, re.search(r"refused steps: (\d+) of (\d+)", first.stdout).groups())
    assert steps == 40 and 0 < refused < steps
    assert "refused steps: 40 of 40" in second.stdout, second.stdout
    assert (tmp_path / "cache" / "exposure").is_dir()  # the counts live where `aegis exposure path` says


def test_the_set_up_is_two_commands_in_a_virtual_environment_and_ci_runs_the_tests_one_verbatim():
    section = re.search(r"## Set-up on a fresh machine\n(.*?)\n## ", (ROOT / "README.md").read_text(), re.S).group(1)
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 2, commands
    tests, main_job = commands
    for command in commands:
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0")
    assert tests.endswith("python -m pytest -q -p no:cacheprovider") and main_job.endswith("aegis audit")
    assert section.index("--index-url") < section.index(tests)  # the CUDA-wheel note comes first
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
