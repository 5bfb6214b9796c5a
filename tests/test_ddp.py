import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dynamics import open_run
from dynamics.callbacks import (
    ActivationBias,
    DynamicsRecorder,
    GradientPlane,
    HiddenStateNorms,
    TrainingLoss,
    UnitHealth,
)
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.teacher_student import _TeacherStream, stream_seed


def test_two_process_ddp_writes_one_file_from_rank_zero(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    path = tmp_path / "ddp.h5"
    trainer = quiet_trainer(
        max_steps=6, strategy="ddp_fork", devices=2, callbacks=[DynamicsRecorder(path)]
    )
    trainer.fit(TeacherStudentModule(**arch), TeacherStudentData(**arch, batch_size=8))
    assert not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp.h5"]
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(6))
    assert np.isfinite(run.series("hidden_norms")["norm"]).all()


def test_ddp_initial_gradient_is_the_average_over_ranks(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    path = tmp_path / "plane.h5"
    trainer = quiet_trainer(
        max_steps=2,
        strategy="ddp_fork",
        devices=2,
        callbacks=[DynamicsRecorder(path, [GradientPlane()])],
    )
    data = TeacherStudentData(**arch, batch_size=8)
    trainer.fit(TeacherStudentModule(**arch), data)
    # rank r trains on its own spawn of the data seed; g0 is the mean of both ranks' gradients
    gradients = []
    for rank in range(2):
        stream = _TeacherStream(
            data.teacher, 8, 8, stream_seed(data.hparams.data_seed, "training data", rank)
        )
        module = TeacherStudentModule(**arch)
        loss = module.dynamics_loss(next(iter(stream)))
        grads = torch.autograd.grad(loss, list(module.parameters()))
        gradients.append(torch.cat([g.reshape(-1) for g in grads]))
    expected = (gradients[0] + gradients[1]) / 2
    np.testing.assert_allclose(open_run(path).vector("g0"), expected.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(gradients[0].numpy(), gradients[1].numpy())  # the check can fail


class PaddedTagger(pl.LightningModule):
    """Tokens to tags through one ReLU used twice; dict batches whose padding differs from
    sample to sample, so that each rank holds a different number of real tokens and a mean of
    the ranks' means would not be the global batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(9, 6)
        self.act = torch.nn.ReLU()
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def training_step(self, batch, batch_idx):
        h = self.act(self.mix(self.act(self.embed(batch["input_ids"]))))
        losses = F.cross_entropy(self.head(h).transpose(1, 2), batch["tags"], reduction="none")
        mask = batch["attention_mask"].float()
        return (losses * mask).sum(1).div(mask.sum(1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 9, (24, 7), generator=generator)
        lengths = torch.randint(1, 8, (24,), generator=generator)
        tags = torch.randint(0, 3, (24, 7), generator=generator)
        mask = (torch.arange(7) < lengths[:, None]).long()
        rows = [
            {"input_ids": ids[i], "tags": tags[i], "attention_mask": mask[i]} for i in range(24)
        ]
        # rank r's batch k is samples 8k + 4r ... 8k + 4r + 3 (use_distributed_sampler=False),
        # the single process's batch k samples 8k ... 8k + 7: the same global batch
        rank, size = (self.global_rank, self.trainer.world_size) if self._trainer else (0, 1)
        per_rank = self.batch_size
        mine = [rows[i] for i in range(24) if i % (per_rank * size) // per_rank == rank]
        return DataLoader(mine, batch_size=per_rank)


def _recorded(run):
    return {
        "loss": run.series("loss")["train"],
        "norm": run.series("hidden_norms")["norm"],
        "bias": run.series("activation_bias")["mean"],
        "dead": run.series("unit_health")["dead"],
    }


def _one_probe():
    return [HiddenStateNorms(modules=["mix", "act"], feature_dim=-1, unit_health=True)]


def _split_probes():  # the same groups from three probes, each with its own hooks
    return [
        HiddenStateNorms(modules=["mix", "act"], feature_dim=-1, activations=False),
        ActivationBias(feature_dim=-1),
        UnitHealth(modules=["mix", "act"], feature_dim=-1),
    ]


@pytest.mark.parametrize("output_probes", [_one_probe, _split_probes])
def test_ddp_records_the_global_batch_as_one_process_over_it_does(
    tmp_path, quiet_trainer, output_probes
):
    def fit(path, batch_size, **trainer):
        torch.manual_seed(0)
        module = PaddedTagger()
        module.batch_size = batch_size
        probes = [TrainingLoss(), *output_probes()]
        recorder = DynamicsRecorder(path, probes)
        quiet_trainer(max_steps=3, callbacks=[recorder], **trainer).fit(module)
        return open_run(path)

    single = fit(tmp_path / "single.h5", 8)
    ddp = fit(tmp_path / "ddp.h5", 4, strategy="ddp_fork", devices=2, use_distributed_sampler=False)
    assert ddp.series("hidden_norms").columns["norm"] == ("act#0", "act#1", "mix")
    for name, value in _recorded(single).items():
        np.testing.assert_allclose(_recorded(ddp)[name], value, rtol=2e-6, atol=1e-7, err_msg=name)
    settings = {p["name"]: p["settings"] for p in ddp.attrs["probes"]}
    assert settings["loss"]["reduce"] == settings["hidden"]["reduce"] == "global"

    # rank 0's micro-batch alone, as before, when asked: another number
    rank0 = tmp_path / "rank0.h5"
    torch.manual_seed(0)
    module = PaddedTagger()
    module.batch_size = 4
    probes = [TrainingLoss(reduce="rank0"), HiddenStateNorms(modules=["mix"], reduce="rank0")]
    trainer = quiet_trainer(
        max_steps=1,
        callbacks=[DynamicsRecorder(rank0, probes)],
        strategy="ddp_fork",
        devices=2,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    torch.manual_seed(0)
    fresh = PaddedTagger()
    fresh.batch_size = 8
    batch = next(iter(fresh.train_dataloader()))
    batch = {k: v[:4] for k, v in batch.items()}  # rank 0's half of the global batch
    h = fresh.mix(fresh.act(fresh.embed(batch["input_ids"]))).norm(dim=-1)
    expected = h[batch["attention_mask"].bool()].mean().item()
    recorded = open_run(rank0).series("hidden_norms")["norm"][0, 0]
    assert recorded == pytest.approx(expected, rel=1e-6)
    assert abs(recorded - _recorded(single)["norm"][0, 0]) > 1e-4
