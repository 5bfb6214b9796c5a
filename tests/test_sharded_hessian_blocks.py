"""BlockHessian under FSDP1 and FSDP2 on two forked gloo processes: the rows equal the DDP
run's over the same batches (each rank its own probe batch, every product averaged), since the
row's operator is on the whole parameters; layer blocks and optimizer-group blocks alike."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from dynamics.callbacks import BlockHessian, DynamicsRecorder, HessianSpectrum
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=2)


def _rows(name: str, folder, blocks) -> dict[str, np.ndarray]:
    measurement = BlockHessian(blocks, k=2, trace_hvp=4, tol=1e-6)
    probe = HessianSpectrum(k=2, every_n_steps=2, tol=1e-6, measurements=[measurement])
    path = folder / f"{name}.h5"
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8)
    recorder = DynamicsRecorder(path, probes=[probe])
    sharded.fit(name, module, data, [recorder], max_steps=3, limit_val_batches=0)
    with h5py.File(path, "r") as file:
        group = file["series/hessian_blocks"]
        rows = {series: group[series][:] for series in group}
        rows["columns"] = group["lambda_max"].attrs["columns"]
    return rows


@pytest.mark.parametrize("blocks", ["layers", "groups"])
def test_sharded_block_rows_equal_the_ddp_runs(blocks, tmp_path) -> None:
    expected = _rows("ddp", tmp_path, blocks)
    assert list(expected["step"]) == [0, 2]
    assert np.isfinite(expected["eigenvalues"]).all()
    for name in ("fsdp1", "fsdp2"):
        got = _rows(name, tmp_path, blocks)
        assert set(got) == set(expected) and got["columns"] == expected["columns"]
        for series in ("lambda_max", "eigenvalues", "trace"):
            np.testing.assert_allclose(
                got[series], expected[series], rtol=1e-4, atol=1e-7, err_msg=f"{name} {series}"
            )
