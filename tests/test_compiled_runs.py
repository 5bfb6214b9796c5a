"""``torch.compile``d runs (issue 22, item 8): the same model compiled or not has one layout,
θ0 hash and description, rebuilds either way, and the probes that differentiate twice measure
the compiled model uncompiled instead of stepping aside.

The compiler backend is ``aot_eager``: it builds the same ``OptimizedModule`` wrapper (the
``_orig_mod.`` prefix) and the AOT-autograd graph that refuses double backward, without the C++
toolchain inductor needs, so it is quick on CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from dynamics import open_run
from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.callbacks import (
    BiasAudit,
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    LossChangeSplit,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main
from dynamics.model.rebuild import rebuild_module
from dynamics.store import names
from tests.conftest import make_quiet_trainer

THIS_FILE = Path(__file__).resolve()
BACKEND = "aot_eager"


class Classifier(pl.LightningModule):
    """Tanh MLP; ``compiled=True`` compiles its network as a submodule (``net._orig_mod``)."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.net = torch.compile(net, backend=BACKEND) if compiled else net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(list(zip(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())), batch_size=8)


def fit(path, compiled: str) -> object:
    """``compiled``: "no", "submodule" (the network) or "module" (``torch.compile`` of the
    LightningModule, which Lightning unwraps and compiles in place)."""
    torch.manual_seed(0)  # one θ0 for every form
    module = Classifier(compiled=compiled == "submodule")
    if compiled == "module":
        module = torch.compile(module, backend=BACKEND)
    probes = [
        ParameterDisplacement(snapshot_every_n_steps=2),
        GradientPlane(),
        TrainingLoss(),
        HessianSpectrum(k=2, every_n_steps=1),
        LossChangeSplit(every_n_steps=1),
        BiasAudit(),
    ]
    make_quiet_trainer(
        max_steps=3,
        callbacks=[DynamicsRecorder(path, probes)],
    ).fit(module)
    return open_run(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    return {form: fit(folder / f"{form}.h5", form) for form in ("no", "submodule", "module")}


@pytest.mark.parametrize("form", ["submodule", "module"])
def test_a_compiled_run_is_the_uncompiled_runs_model(runs, form):
    plain, compiled = runs["no"], runs[form]
    assert compiled.layout == plain.layout
    assert "_orig_mod" not in " ".join(compiled.layout.names)
    assert compiled.attrs[names.ATTR_THETA0_SHA256] == plain.attrs[names.ATTR_THETA0_SHA256]
    assert compiled.attrs[names.ATTR_SUBMODULES] == plain.attrs[names.ATTR_SUBMODULES]
    assert compiled.attrs[names.ATTR_COMPILED] == (["net"] if form == "submodule" else [""])
    assert plain.attrs[names.ATTR_COMPILED] == []
    setup = dict(setup_rows(compiled))  # what report and compare show
    assert setup["torch.compile"] == (
        "net compiled" if form == "submodule" else "the whole module compiled"
    )
    assert dict(setup_rows(plain))["torch.compile"] == "not compiled"
    # Measured, not stepped aside: no event (the audit's was a dynamo dump), and the Hessian's
    # eigenvalues, which need double backward, are the uncompiled model's.
    assert list(compiled.events()) == []
    assert recorded_audit(compiled).to_dict() == recorded_audit(plain).to_dict()
    eigen = {
        r: r.series(names.HESSIAN).values[names.HESSIAN_EIGENVALUES] for r in (plain, compiled)
    }
    assert eigen[compiled].shape == eigen[plain].shape == (3, 2)
    assert eigen[compiled] == pytest.approx(eigen[plain], rel=1e-5)
    terms = {r: r.series(names.LOSS_CHANGE).values[names.LOSS_CHANGE_TERMS] for r in runs.values()}
    assert terms[compiled] == pytest.approx(terms[plain], rel=1e-6, abs=1e-12)


def test_each_rebuilds_into_the_other_and_compare_accepts_the_pair(runs, tmp_path, capsys):
    plain, compiled = runs["no"], runs["submodule"]
    model = f"{THIS_FILE}:Classifier"
    into_plain = rebuild_module(compiled, model, {"compiled": False})
    into_compiled = rebuild_module(plain, model, {"compiled": True})
    for module in (into_plain, into_compiled):
        rebuilt = dict(module.named_parameters())
        theta0 = plain.layout.split(torch.from_numpy(plain.stored_states()[0].theta))
        for name, value in zip(plain.layout.names, theta0):
            key = name if name in rebuilt else name.replace("net.", "net._orig_mod.", 1)
            assert torch.equal(rebuilt[key].detach(), value)
    out = tmp_path / "compare.html"
    capsys.readouterr()
    code = main(["compare", str(plain.path), str(compiled.path), "-o", str(out), "--model", model])
    assert code == 0, capsys.readouterr().err
    page = out.read_text()
    assert "not comparable" not in page and "different init" not in page
    assert "no loss barrier" not in page and "θT(no) → θT(submodule)" in page
