"""Every script in examples/ runs as a user runs it, and writes only into the folder it is given.

Each runs in its own process, from an empty working directory, with that directory's ``out``
folder as its argument: the test fails when a script exits non-zero, leaves out a file its
docstring promises, or writes anything anywhere else in the working directory or examples/.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# What each script promises to write into its folder.
OUTPUTS = {
    "record_a_run.py": {"run.h5", "run.html"},
    "compare_two_runs.py": {"lr_0.05.h5", "lr_0.2.h5", "compare.html"},
    "notebook_api.py": {"run.h5", "loss.html"},
    "write_a_probe.py": {"run.h5", "run.html"},
    "huggingface_trainer.py": {"run.h5", "run.html"},
    "plain_loop.py": {"run.h5", "last.ckpt", "run.html"},
    "accelerate_loop.py": {"run.h5", "run.html"},
}


def test_every_example_script_is_run_here():
    scripts = {path.name for path in EXAMPLES.glob("*.py") if path.name != "tiny_model.py"}
    assert scripts == set(OUTPUTS)


@pytest.mark.parametrize("script", sorted(OUTPUTS))
def test_example_runs_and_writes_only_into_its_folder(script, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    examples_before = sorted(EXAMPLES.rglob("*"))
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "out"],
        cwd=work,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in work.iterdir()) == ["out"]
    written = {path.name for path in (work / "out").iterdir()}
    assert written == OUTPUTS[script]
    assert sorted(EXAMPLES.rglob("*")) == examples_before
