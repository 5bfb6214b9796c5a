"""dynamics.record(..., accelerator=...): an accelerate loop's run file, in one process and in
two forked ones (DDP through accelerate, gloo), against the plain loop's of the same fit."""

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import dynamics
from dynamics.callbacks import HessianSpectrum
from tests import tiny_gpt2
from tests.forked import run_ranks
from tests.test_plain_loop import _batches, _default_probes, _rows, _Unrecorded, train


def _accelerator(**options) -> Accelerator:
    # accelerate keeps its state in process-wide singletons: each fit starts from none.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **options)


def accelerate_fit(
    path, *, accumulate=1, probes=None, batches=None, state=None, net=None, opt=None
):
    """The accelerate loop over ``batches`` (default: the whole loader), recorded into ``path``
    (None: not recorded); returns the unwrapped model, the prepared optimizer and the
    recorder's state at the end."""
    accelerator = _accelerator(gradient_accumulation_steps=accumulate)
    if net is None:
        net = tiny_gpt2.model()
        opt = tiny_gpt2.optimizer(net)
    model, opt = accelerator.prepare(net, opt)
    loader = batches if batches is not None else accelerator.prepare(tiny_gpt2.loader())
    recorder = _Unrecorded()
    if path is not None:
        probes = _default_probes() if probes is None else probes
        recorder = dynamics.record(
            path, model, opt, loss_fn=tiny_gpt2.loss, probes=probes, accelerator=accelerator
        )
        if state is not None:
            recorder.load_state_dict(state)
    with recorder:
        for batch in loader:
            with accelerator.accumulate(model), recorder.batch(batch) as b:
                loss = tiny_gpt2.loss(model, batch)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                b.loss(loss)
        end_state = recorder.state_dict() if path is not None else None
    return accelerator.unwrap_model(model), opt, end_state


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_accelerate_loop_records_what_the_plain_loop_records(tmp_path, accumulate):
    probes = [*_default_probes(), HessianSpectrum(k=1, every_n_steps=2, max_hvp=20)]
    recorded, _, _ = accelerate_fit(tmp_path / "acc.h5", accumulate=accumulate, probes=probes)
    unrecorded, _, _ = accelerate_fit(None, accumulate=accumulate)
    for (name, a), b in zip(recorded.named_parameters(), unrecorded.parameters()):
        assert torch.equal(a, b), name  # training unperturbed
    train(tmp_path / "plain.h5", _batches(), accumulate=accumulate)
    acc, plain = dynamics.open_run(tmp_path / "acc.h5"), dynamics.open_run(tmp_path / "plain.h5")
    assert acc.status().state == "finished"
    assert len(acc.series("loss")) == 8 // accumulate
    assert (acc.attrs["loop"], acc.attrs["precision"]) == ("accelerate", "no")
    assert "accelerate" in acc.attrs["versions"]
    # accelerate divides the loss by the accumulation count before backward, as the plain loop
    # does by hand: the same arithmetic, equal to the bit
    for key, values in _rows(plain).items():
        np.testing.assert_array_equal(_rows(acc)[key], values, err_msg=str(key))
    assert np.all(np.isfinite(acc.series("hessian")["eigenvalues"]))


def test_a_resumed_accelerate_loop_continues_the_file(tmp_path):
    batches = _batches()
    accelerate_fit(tmp_path / "whole.h5", accumulate=2)
    path = tmp_path / "resumed.h5"
    net, opt, state = accelerate_fit(path, accumulate=2, batches=batches[:4])
    checkpoint = tmp_path / "last.ckpt"
    saved = {"model": net.state_dict(), "optimizer": opt.state_dict(), "dynamics": state}
    torch.save(saved, checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    net = tiny_gpt2.model()
    net.load_state_dict(saved["model"])
    opt = tiny_gpt2.optimizer(net)
    opt.load_state_dict(saved["optimizer"])
    state = saved["dynamics"]
    accelerate_fit(path, accumulate=2, batches=batches[4:], state=state, net=net, opt=opt)
    whole, resumed = dynamics.open_run(tmp_path / "whole.h5"), dynamics.open_run(path)
    for key, values in _rows(whole).items():
        np.testing.assert_array_equal(_rows(resumed)[key], values, err_msg=str(key))


def test_an_optimizer_prepared_by_accelerate_needs_its_accelerator(tmp_path):
    accelerator = _accelerator()
    model, opt = accelerator.prepare(tiny_gpt2.model(), tiny_gpt2.optimizer(tiny_gpt2.model()))
    with pytest.raises(TypeError, match="accelerator=accelerator"):
        dynamics.record(tmp_path / "run.h5", model, opt)


def _ddp_rank(rank, path, params):
    net, _, _ = accelerate_fit(path)
    if rank == 0:
        torch.save(net.state_dict(), params)
    torch.distributed.destroy_process_group()


def test_ddp_through_accelerate_records_what_one_process_accumulating_records(tmp_path):
    run_ranks(_ddp_rank, tmp_path / "ddp.h5", tmp_path / "recorded.pt")
    run_ranks(_ddp_rank, None, tmp_path / "unrecorded.pt")
    recorded, unrecorded = (torch.load(tmp_path / f"{n}.pt") for n in ("recorded", "unrecorded"))
    assert all(torch.equal(recorded[k], unrecorded[k]) for k in recorded)  # training unperturbed
    # accelerate gives rank r the batches r, r + 2, ...: each step of the two ranks is the one
    # process's step of two accumulated micro-batches (equal to the bit, as for plain DDP)
    train(tmp_path / "single.h5", _batches(), accumulate=2)
    ddp, single = dynamics.open_run(tmp_path / "ddp.h5"), dynamics.open_run(tmp_path / "single.h5")
    assert ddp.status().state == "finished"
    for key, values in _rows(single).items():
        np.testing.assert_array_equal(_rows(ddp)[key], values, err_msg=str(key))
