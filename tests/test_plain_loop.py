"""dynamics.record: a plain PyTorch loop's run file, the same as Lightning's for the same fit."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

import dynamics
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.store import RunFileError
from tests import tiny_gpt2
from tests.forked import run_ranks
from tests.sharded import shard_with_fsdp2

ROOT = Path(__file__).resolve().parents[1]
#: The series a plain loop and Lightning compute by the same arithmetic: equal to the bit.
SAME_ARITHMETIC = ("loss", "hidden_norms", "activation_bias", "displacement")


def _default_probes():
    return [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement(snapshot_every_n_steps=4)]


def train(path, batches, *, probes=None, accumulate=1, state=None, net=None, opt=None, **options):
    """The plain loop over ``batches`` (dict batches), recorded into ``path`` (None: not
    recorded); returns the model, the optimizer and the recorder's state at the end."""
    if net is None:
        net = tiny_gpt2.model()
        opt = tiny_gpt2.optimizer(net)
    probes = _default_probes() if probes is None else probes
    rec = None
    if path is not None:
        rec = dynamics.record(
            path,
            net,
            opt,
            loss_fn=tiny_gpt2.loss,
            probes=probes,
            accumulate_grad_batches=accumulate,
            **options,
        )
        if state is not None:
            rec.load_state_dict(state)
    with rec if rec is not None else _Unrecorded() as recorder:
        for i, batch in enumerate(batches):
            with recorder.batch(batch) as b:
                loss = tiny_gpt2.loss(net, batch)
                (loss / accumulate).backward()
                if (i + 1) % accumulate == 0:
                    opt.step()
                    opt.zero_grad()
                b.loss(loss)
        end_state = rec.state_dict() if rec is not None else None
    return net, opt, end_state


class _Unrecorded:
    """The same loop with no recorder: ``batch`` does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def batch(self, batch):
        return self

    def loss(self, loss):
        pass


def _batches(count=32, batch_size=tiny_gpt2.BATCH):
    return list(tiny_gpt2.loader(count, batch_size))


def _rows(run, groups=SAME_ARITHMETIC):
    return {
        (group, name): values
        for group in groups
        for name, values in {"step": run.series(group).step, **run.series(group).values}.items()
    }


def test_a_plain_loop_writes_a_run_file_the_offline_tools_read(tmp_path):
    path = tmp_path / "plain.h5"
    probes = [
        *_default_probes(),
        HessianSpectrum(k=1, every_n_steps=4, max_hvp=20),
        GradientPlane(),
        LoggedMetrics(),
    ]
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    batches = _batches()
    with dynamics.record(path, net, opt, loss_fn=tiny_gpt2.loss, probes=probes) as rec:
        for batch in batches:
            with rec.batch(batch) as b:
                loss = tiny_gpt2.loss(net, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                b.loss(loss)
            if rec.global_step % 4 == 0:
                with torch.no_grad():
                    rec.validation(metrics={"val_loss": tiny_gpt2.loss(net, batches[0])})
    run = dynamics.open_run(path)
    assert run.status().state == "finished"
    np.testing.assert_array_equal(run.series("loss").step, np.arange(8))
    np.testing.assert_array_equal(run.series("hessian").step, [0, 4])
    assert np.all(np.isfinite(run.series("hessian")["eigenvalues"]))
    np.testing.assert_array_equal(run.series("validation").step, [4, 8])
    assert run.vector("g0") is not None
    assert run.attrs["loop"] == "plain"
    assert run.attrs["loss_rule"] == {"rule": "function", "function": "tests.tiny_gpt2:loss"}
    assert [e for e in run.events() if e.kind == "error"] == []
    other = tmp_path / "other.h5"
    train(other, batches[:4])
    command = str(Path(sys.executable).with_name("dynamics"))
    for args in (
        ["report", str(path)],
        ["compare", str(path), str(other), "--barrier-points", "0"],
    ):
        done = subprocess.run(
            [command, *args, "-o", str(tmp_path / f"{args[0]}.html")],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert (tmp_path / f"{args[0]}.html").stat().st_size > 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_is_bit_identical_with_and_without_the_recorder(tmp_path, accumulate):
    probes = [
        *_default_probes(),
        HessianSpectrum(k=1, every_n_steps=2, max_hvp=10),
        GradientPlane(),
    ]
    recorded, _, _ = train(tmp_path / "run.h5", _batches(16), probes=probes, accumulate=accumulate)
    plain, _, _ = train(None, _batches(16), accumulate=accumulate)
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_under_accumulation_the_loss_is_the_mean_of_the_unscaled_micro_batch_losses(tmp_path):
    batches = _batches(16)
    train(tmp_path / "run.h5", batches, accumulate=2)
    run = dynamics.open_run(tmp_path / "run.h5")
    np.testing.assert_array_equal(run.series("loss").step, np.arange(2))
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    expected = []
    for first, second in zip(batches[::2], batches[1::2]):
        losses = [tiny_gpt2.loss(net, first), tiny_gpt2.loss(net, second)]
        expected.append(float(torch.stack([loss.detach() for loss in losses]).mean()))
        for loss in losses:
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    np.testing.assert_array_equal(run.series("loss")["train"], np.float32(expected))


def test_a_shorter_last_step_ends_where_the_optimizer_stepped(tmp_path):
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    batches = _batches(12)  # 3 batches: one step of 2, then a last step of 1
    with dynamics.record(tmp_path / "run.h5", net, opt, accumulate_grad_batches=2) as rec:
        for i, batch in enumerate(batches):
            with rec.batch(batch) as b:
                loss = tiny_gpt2.loss(net, batch)
                (loss / 2).backward()
                if i % 2 == 1 or i == len(batches) - 1:
                    opt.step()
                    opt.zero_grad()
                b.loss(loss)
    assert rec.global_step == 2
    np.testing.assert_array_equal(
        dynamics.open_run(tmp_path / "run.h5").series("loss").step, [0, 1]
    )


def _restored(checkpoint):
    saved = torch.load(checkpoint, weights_only=True)
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return net, opt, saved["dynamics"]


def test_a_resumed_loop_continues_the_file_as_an_uninterrupted_one_wrote_it(tmp_path):
    batches = _batches()

    def probes():
        return [*_default_probes(), HessianSpectrum(k=1, every_n_steps=2, max_hvp=20)]

    train(tmp_path / "whole.h5", batches, probes=probes())
    path = tmp_path / "resumed.h5"
    net, opt, state = train(path, batches[:3], probes=probes())
    checkpoint = tmp_path / "last.ckpt"
    torch.save(
        {"model": net.state_dict(), "optimizer": opt.state_dict(), "dynamics": state}, checkpoint
    )
    # A fit resumed from the checkpoint crashes two steps later: those rows are recorded again.
    net, opt, state = _restored(checkpoint)
    with pytest.raises(RuntimeError, match="power cut"):
        train(path, _Crashing(batches[3:5]), probes=probes(), state=state, net=net, opt=opt)
    assert dynamics.open_run(path).status().state == "crashed"
    net, opt, state = _restored(checkpoint)
    train(path, batches[3:], probes=probes(), state=state, net=net, opt=opt)
    whole, resumed = dynamics.open_run(tmp_path / "whole.h5"), dynamics.open_run(path)
    assert resumed.status().state == "finished"
    groups = (*SAME_ARITHMETIC, "hessian")
    for key, values in _rows(whole, groups).items():
        np.testing.assert_array_equal(_rows(resumed, groups)[key], values, err_msg=str(key))
    np.testing.assert_array_equal(resumed.vector("theta_final"), whole.vector("theta_final"))


class _Crashing:
    """The batches, then an exception inside the loop."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches
        raise RuntimeError("power cut")


def test_an_exception_inside_the_with_block_closes_the_file_as_crashed(tmp_path):
    net = tiny_gpt2.model()
    batch = _batches(4)[0]
    with pytest.raises(ValueError, match="bad batch"):
        with dynamics.record(tmp_path / "run.h5", net, tiny_gpt2.optimizer(net)) as rec:
            with rec.batch(batch) as b:
                b.loss(tiny_gpt2.loss(net, batch))
            with rec.batch(batch):
                raise ValueError("bad batch")
    status = dynamics.open_run(tmp_path / "run.h5").status()
    assert (status.state, status.exception) == ("crashed", "ValueError: bad batch")


def _entered(tmp_path, **options):
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    return net, opt, dynamics.record(tmp_path / "run.h5", net, opt, overwrite=True, **options)


def test_misuse_is_refused_in_one_clear_line(tmp_path):
    batch = _batches(4)[0]
    net, opt, rec = _entered(tmp_path)
    with pytest.raises(RuntimeError, match="outside `with dynamics.record"):
        with rec.batch(batch):
            pass
    with rec:
        with pytest.warns(UserWarning, match="before the first rec.batch is not recorded"):
            rec.validation({"val_loss": 1.0})
        with rec.batch(batch) as b:
            with pytest.raises(RuntimeError, match="inside another rec.batch"):
                with rec.batch(batch):
                    pass
            with pytest.raises(RuntimeError, match="inside a rec.batch block"):
                rec.validation({"val_loss": 1.0})
            with pytest.raises(RuntimeError, match="middle of an optimizer step"):
                rec.state_dict()
            with pytest.raises(TypeError, match="scalar loss tensor"):
                b.loss(1.0)
        with pytest.raises(RuntimeError, match="block ended"):
            b.loss(torch.tensor(1.0))
        with pytest.raises(RuntimeError, match="after `with rec:` began"):
            rec.load_state_dict({})
        tiny_gpt2.loss(net, batch).backward()
        opt.step()  # outside any rec.batch: the steps would be miscounted
        with pytest.raises(RuntimeError, match="optimizer stepped outside"):
            with rec.batch(batch):
                pass
    with pytest.raises(RuntimeError, match="entered once"):
        with rec:
            pass
    net, opt, rec = _entered(tmp_path, accumulate_grad_batches=2)
    with rec:
        with rec.batch(batch) as b:
            tiny_gpt2.loss(net, batch).backward()
        with pytest.raises(RuntimeError, match=re.escape("(1 of 2 micro-batches done)")):
            rec.state_dict()
    with pytest.raises(TypeError, match="what rec.state_dict\\(\\) returned"):
        _entered(tmp_path)[2].load_state_dict({"last_step": 3})
    with pytest.raises(ValueError, match="at least 1"):
        _entered(tmp_path, accumulate_grad_batches=0)


def test_a_new_run_refuses_an_existing_file_before_any_batch(tmp_path):
    train(tmp_path / "run.h5", _batches(8))
    net = tiny_gpt2.model()
    with pytest.raises(RunFileError, match="exists"):
        with dynamics.record(tmp_path / "run.h5", net, tiny_gpt2.optimizer(net)):
            pass


def test_without_a_loss_function_the_probes_needing_one_step_aside(tmp_path):
    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(3, 4)
            self.out = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(torch.relu(self.inp(x)))

    torch.manual_seed(0)
    net = Regressor()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probes = [TrainingLoss(), HessianSpectrum(k=1, every_n_steps=1, max_hvp=5)]
    with pytest.warns(UserWarning, match="no loss_fn"):
        with dynamics.record(tmp_path / "run.h5", net, opt, probes=probes) as rec:
            for _ in range(3):
                x = torch.randn(8, 3)
                with rec.batch(x) as b:
                    loss = net(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    b.loss(loss)
    run = dynamics.open_run(tmp_path / "run.h5")
    assert len(run.series("loss")) == 3
    [event] = [e for e in run.events() if e.probe == "hessian"]
    assert "pass loss_fn=" in event.message
    # a Hugging Face model computes its own loss: model(**batch).loss
    net = tiny_gpt2.model()
    with dynamics.record(tmp_path / "hf.h5", net, tiny_gpt2.optimizer(net)) as rec:
        assert rec.fit.loss_rule.to_dict() == {"rule": "output"}


def _ddp_rank(rank, path, params):
    """Rank ``rank`` of a plain DDP loop: it trains on every other batch (rank r takes batches
    r, r + 2, ...), so the two ranks' step is the single process's step of two micro-batches."""
    from torch.nn.parallel import DistributedDataParallel

    torch.distributed.init_process_group("gloo")
    try:
        net = tiny_gpt2.model()
        model = DistributedDataParallel(net)
        opt = tiny_gpt2.optimizer(model)
        recorder = _Unrecorded()
        if path is not None:
            recorder = dynamics.record(
                path, model, opt, loss_fn=tiny_gpt2.loss, probes=_default_probes()
            )
        with recorder:
            for batch in _batches()[rank::2]:
                with recorder.batch(batch) as b:
                    loss = tiny_gpt2.loss(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    b.loss(loss)
        if rank == 0:
            torch.save(net.state_dict(), params)
    finally:
        torch.distributed.destroy_process_group()


def _untied_gpt2():
    """The tiny GPT-2 with its own output matrix: ``fully_shard`` of the embedding's and the
    head's modules apart would untie a tied one, and train another model than DDP's."""
    config = tiny_gpt2.config()
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _sharded_rank(rank, path, sharding):
    """Rank ``rank`` of a plain loop under ``sharding`` (``"ddp"`` or FSDP2's ``"fsdp2"``)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.distributed.init_process_group("gloo")
    try:
        net = _untied_gpt2()
        if sharding == "fsdp2":
            shard_with_fsdp2(net)  # in place: the model is its own wrapper
        model = net if sharding == "fsdp2" else DistributedDataParallel(net)
        opt = tiny_gpt2.optimizer(model)
        probes = _default_probes()
        with dynamics.record(path, model, opt, loss_fn=tiny_gpt2.loss, probes=probes) as rec:
            for batch in _batches()[rank::2]:
                with rec.batch(batch) as b:
                    loss = tiny_gpt2.loss(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    b.loss(loss)
    finally:
        torch.distributed.destroy_process_group()


def test_an_fsdp2_loop_records_what_ddp_records(tmp_path):
    for sharding in ("ddp", "fsdp2"):
        run_ranks(_sharded_rank, tmp_path / f"{sharding}.h5", sharding)
    ddp, fsdp2 = (dynamics.open_run(tmp_path / f"{n}.h5") for n in ("ddp", "fsdp2"))
    assert fsdp2.status().state == "finished"
    assert fsdp2.theta0_sha256 == ddp.theta0_sha256  # the unsharded model's layout and hash
    assert fsdp2.layout.names == ddp.layout.names
    # FSDP2 reduce-scatters the gradients where DDP all-reduces them: measured equal to the bit
    # but for the displacement (relative differences up to 4e-6, the update's)
    for key, values in _rows(ddp).items():
        np.testing.assert_allclose(
            _rows(fsdp2)[key], values, rtol=2e-5, atol=1e-7, err_msg=str(key)
        )


def test_a_ddp_loop_records_what_one_process_accumulating_its_batches_records(tmp_path):
    run_ranks(_ddp_rank, tmp_path / "ddp.h5", tmp_path / "recorded.pt")
    run_ranks(_ddp_rank, None, tmp_path / "unrecorded.pt")
    recorded, unrecorded = (torch.load(tmp_path / f"{n}.pt") for n in ("recorded", "unrecorded"))
    assert all(torch.equal(recorded[k], unrecorded[k]) for k in recorded)  # training unperturbed
    train(tmp_path / "single.h5", _batches(), accumulate=2)
    ddp, single = dynamics.open_run(tmp_path / "ddp.h5"), dynamics.open_run(tmp_path / "single.h5")
    assert ddp.status().state == "finished"
    assert not (tmp_path / "ddp.h5").with_suffix(".h5.lock").exists()
    # Equal to the bit: DDP's mean of two gradients, (g0 + g1) / 2, and the accumulated
    # g0 / 2 + g1 / 2 round alike (halving is exact), and the ranks' sums add two terms.
    for key, values in _rows(single).items():
        np.testing.assert_array_equal(_rows(ddp)[key], values, err_msg=str(key))


@pytest.mark.parametrize(
    ("page", "script"), [("plain.md", "plain_loop.py"), ("accelerate.md", "accelerate_loop.py")]
)
def test_each_loop_page_shows_its_tested_example_in_full(page, script):
    text = (ROOT / "docs" / "loops" / page).read_text()
    example = text.split("## A complete example")[1]
    [code] = re.findall(r"```python\n(.*?)```", example, flags=re.DOTALL)
    assert code == (ROOT / "examples" / script).read_text()  # tests/test_examples.py runs it


def test_import_dynamics_stays_torch_free_until_record_is_used():
    code = (
        "import sys, dynamics\n"
        "assert 'torch' not in sys.modules and 'record' in dynamics.__all__\n"
        "assert callable(dynamics.record) and 'torch' in sys.modules\n"
        "assert 'accelerate' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _ddp_resume_rank(rank, path, steps, checkpoint):
    """Rank ``rank`` of a plain DDP loop over ``steps`` (a range of optimizer steps), resumed
    from ``checkpoint`` when it exists and saving it at the end: every rank takes the
    recorder's state together, rank zero saves."""
    from torch.nn.parallel import DistributedDataParallel

    torch.distributed.init_process_group("gloo")
    try:
        net = tiny_gpt2.model()
        opt = tiny_gpt2.optimizer(net)
        probes = [*_default_probes(), HessianSpectrum(k=1, every_n_steps=2, max_hvp=20)]
        model = DistributedDataParallel(net)
        rec = dynamics.record(path, model, opt, probes=probes)
        if checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=True)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            rec.load_state_dict(saved["dynamics"])
        with rec:
            for batch in _batches()[rank::2][steps.start : steps.stop]:
                with rec.batch(batch) as b:
                    loss = tiny_gpt2.loss(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    b.loss(loss)
            state = rec.state_dict()  # collective: every rank, though rank zero alone saves
        if rank == 0:
            saved = {"model": net.state_dict(), "optimizer": opt.state_dict(), "dynamics": state}
            torch.save(saved, checkpoint)
    finally:
        torch.distributed.destroy_process_group()


def test_a_resumed_ddp_loop_continues_the_file_as_an_uninterrupted_one_wrote_it(tmp_path):
    run_ranks(_ddp_resume_rank, tmp_path / "whole.h5", range(0, 4), tmp_path / "whole.ckpt")
    for steps in (range(0, 2), range(2, 4)):
        run_ranks(_ddp_resume_rank, tmp_path / "resumed.h5", steps, tmp_path / "resumed.ckpt")
    whole, resumed = (dynamics.open_run(tmp_path / f"{n}.h5") for n in ("whole", "resumed"))
    assert resumed.status().state == "finished"
    groups = (*SAME_ARITHMETIC, "hessian")
    for key, values in _rows(whole, groups).items():
        np.testing.assert_array_equal(_rows(resumed, groups)[key], values, err_msg=str(key))


# Last in the file: a fork after a Lightning fit or a torch.compile in this process (the tests
# above fork their ranks) was seen to hang in the forked ranks.
def test_a_compiled_model_records_what_the_model_itself_records(tmp_path):
    batches = _batches(16)
    train(tmp_path / "eager.h5", batches)
    net = tiny_gpt2.model()
    opt = tiny_gpt2.optimizer(net)
    compiled = torch.compile(net, backend="eager")  # the wrapper, without a compiler's cost
    probes = _default_probes()
    with dynamics.record(tmp_path / "compiled.h5", compiled, opt, probes=probes) as rec:
        assert rec.fit.module is net
        for batch in batches:
            with rec.batch(batch) as b:
                loss = tiny_gpt2.loss(compiled, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                b.loss(loss)
    eager, compiled = (dynamics.open_run(tmp_path / f"{n}.h5") for n in ("eager", "compiled"))
    assert compiled.theta0_sha256 == eager.theta0_sha256
    assert compiled.layout.names == eager.layout.names
    for key, values in _rows(eager).items():
        np.testing.assert_array_equal(_rows(compiled)[key], values, err_msg=str(key))


def test_a_lightning_fit_of_the_same_model_and_data_records_the_same_rows(tmp_path, quiet_trainer):
    batches = _batches()
    train(tmp_path / "plain.h5", batches)
    lightning = tmp_path / "lightning.h5"
    recorder = DynamicsRecorder(lightning, _default_probes())
    trainer = quiet_trainer(max_steps=len(batches), callbacks=[recorder])
    trainer.fit(tiny_gpt2.LightningGPT2(), tiny_gpt2.loader())
    plain, other = dynamics.open_run(tmp_path / "plain.h5"), dynamics.open_run(lightning)
    assert (plain.attrs["loop"], other.attrs["loop"]) == ("plain", "lightning")
    assert plain.theta0_sha256 == other.theta0_sha256
    for key, values in _rows(other).items():  # the same arithmetic: equal to the bit
        np.testing.assert_array_equal(_rows(plain)[key], values, err_msg=str(key))
    np.testing.assert_array_equal(plain.vector("theta_final"), other.vector("theta_final"))
