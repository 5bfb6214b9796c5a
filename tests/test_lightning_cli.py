from pathlib import Path

import numpy as np
import yaml
from pytorch_lightning.cli import LightningCLI

from dynamics import open_run

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lightning_cli.yaml"


def test_recorder_configured_through_lightning_cli(tmp_path, monkeypatch):
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"].update(max_steps=6, enable_progress_bar=False, enable_model_summary=False)
    config["model"]["init_args"].update(width=8, expansion=2, depth=2)
    config["data"]["init_args"] = dict(width=8, expansion=2, depth=2, batch_size=8)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    run = open_run(tmp_path / "runs" / "lightning_cli" / "student.h5")
    np.testing.assert_array_equal(run.series("hidden_norms").step, [0, 2, 4])
    assert run.attrs["module"]["class_path"].endswith("TeacherStudentModule")
    assert run.attrs["module"]["init_args"]["shift"] == "expected"
