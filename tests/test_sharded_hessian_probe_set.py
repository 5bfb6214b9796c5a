"""HessianSpectrum over a probe set under FSDP1 and FSDP2 on two forked gloo processes: the rows
(eigenvalues, the per-batch spread, trace, loss) equal the DDP run's; the DDP operator itself is
checked against dense Hessians in tests/test_hessian_probe_set.py."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, HessianSpectrum, HessianTrace
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=2)


def _set() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator))
        for _ in range(3)
    ]


def _fit(name: str, folder) -> dict:
    path = folder / f"{name}.h5"
    probe = HessianSpectrum(
        k=2, every_n_steps=2, tol=1e-6, batches=_set(), measurements=[HessianTrace(hvp=8)]
    )
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8)
    recorder = DynamicsRecorder(path, probes=[probe])
    sharded.fit(name, module, data, [recorder], max_steps=3, limit_val_batches=0)
    with h5py.File(path, "r") as file:
        rows = {s: file[f"series/hessian/{s}"][:] for s in file["series/hessian"]}
    return {"rows": rows, "events": open_run(path).events()}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _fit("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_a_probe_set_under_fsdp_records_the_ddp_rows(name, tmp_path, ddp):
    got = _fit(name, tmp_path)
    assert got["events"] == [] and ddp["events"] == []
    assert set(got["rows"]) == set(ddp["rows"])
    assert ddp["rows"]["batch_rayleigh"].shape == (2, 3)
    for series in ("eigenvalues", "batch_rayleigh", "batch_rayleigh_std", "trace", "loss"):
        np.testing.assert_allclose(
            got["rows"][series], ddp["rows"][series], rtol=1e-4, atol=1e-7, err_msg=series
        )
