"""A new user's sharded fits (issue 24): models the FSDP ports were not designed around, each
recorded under DDP and under FSDP1/FSDP2 on two forked gloo processes, rows compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.fsdp import fully_shard

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, HessianSpectrum, TrainingLoss
from tests import sharded
from tests.conftest import SmallCNN


class ShardedSmallCNN(SmallCNN):
    """SmallCNN as a user shards it for FSDP2: each top-level child, then the root."""

    def configure_model(self) -> None:
        fully_shard(self.features)
        fully_shard(self.head)
        fully_shard(self)


def _hessian_rows(name: str, path) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    module = (ShardedSmallCNN if name == "fsdp2" else SmallCNN)()
    probes = [TrainingLoss(), HessianSpectrum(k=2, every_n_steps=2)]
    sharded.fit(name, module, None, [DynamicsRecorder(path, probes)], limit_val_batches=0)
    series = open_run(path).series("hessian")
    return {"step": series.step} | {k: np.asarray(series[k]) for k in ("loss", "eigenvalues")}


@pytest.mark.xfail(
    strict=True,
    reason="BatchNorm CNN, HessianSpectrum in eval mode: DDP broadcasts rank 0's buffers before "
    "each forward, FSDP leaves every rank its own running statistics, so rank 1's loss (averaged "
    "into the row) differs from step 2 on (4e-5 relative); with DDP(broadcast_buffers=False) "
    "FSDP1 equals DDP exactly. Needs one rule for the buffers of extra passes under every strategy",
)
@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_batchnorm_cnn_hessian_rows_equal_ddp(name, tmp_path):
    expected = _hessian_rows("ddp", tmp_path / "ddp.h5")
    got = _hessian_rows(name, tmp_path / f"{name}.h5")
    np.testing.assert_array_equal(got["step"], expected["step"])
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["eigenvalues"], expected["eigenvalues"], rtol=1e-4)
