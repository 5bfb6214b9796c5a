"""What the user gives and what a file says is checked before anything happens.

Every bad option or config value is refused with one line and exit 2 before a file is created
(an existing file is left as it was); a run that fails removes what it created; output that
cannot be written ends in one line, a reader that stops early in none. A run file is data: its
recorded model class is imported only from the installed packages (or with the user's word),
and called only if it is a ``torch.nn.Module``.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import h5py
import pytest
import yaml

from dynamics.cli import main
from dynamics.experiments import runner
from dynamics.store import RunLock, names
from dynamics.store.schema import encode_attr
from tests.conftest import DYNAMICS, TINY_EXPERIMENT, assert_one_line_error

#: A pre-existing file in the output folder that no refused command may touch.
MINE = "the user's own file"


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused_in_process(argv: list, capsys, message: str) -> None:
    """``main(argv)`` exits 2 with one line on stderr that contains ``message``."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynamics: error: "), err
    assert message in err, err


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


# ---------------------------------------------------------------------------------------------
# dynamics run: options and config values


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--seed", str(2**70)], "--seed must be a number from 0 to"),
        (["--seed", "-1"], "--seed must be a number from 0 to"),
        (["--steps", "0"], "--steps must be a number from 1 to"),
    ],
)
def test_bad_run_options_are_refused_before_any_file(tmp_path, capsys, options, message):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    out = tmp_path / "out"
    out.mkdir()
    (out / "unshifted.h5").write_text(MINE)
    before = files_under(tmp_path)
    refused_in_process(
        ["run", tmp_path / "tiny.yaml", "--out", out, "--overwrite", *options], capsys, message
    )
    assert files_under(tmp_path) == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": {"activation": "foo"}}, "model.activation must be one of"),
        ({"optimizer": {"name": "foo"}}, "optimizer.name must be one of"),
        ({"model": {"nope": 1}}, "unknown config key 'model.nope'"),
        ({"nope": 1}, "unknown config key 'nope'"),
        ({"record": {"snapshot_budget_mb": 0.0001}}, "holds fewer than 2 snapshots"),
        ({"record": {"snapshot_budget_mb": -1.0}}, "snapshot_budget_mb must be >= 0"),
        ({"record": {"hessian_top_k": 100000}}, "hessian_top_k must be at most the model's"),
        ({"record": {"flush_interval_s": math.inf}}, "'record.flush_interval_s' must be a finite"),
        ({"record": {"flush_interval_s": 0.0}}, "record.flush_interval_s must be > 0"),
        ({"model": {"width": 100000}, "record": {"snapshot_budget_mb": 0}}, "GiB of memory"),
        ({"optimizer": {"lr": math.nan}}, "'optimizer.lr' must be a finite number"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"data": {"teacher_seed": -3}}, "data.teacher_seed must be >= 0"),
        ({"steps": 10**21}, "'steps' must fit in 64 bits"),
        ({"threads": 100000}, "threads must be at most this machine's"),
        ({"eval_every": 1000}, "eval_every (1000) must be at most steps (30)"),
        ({"variants": {"a": math.nan, "b": "expected"}}, "variants.a: shift must be one of"),
        ({"variants": {"a": 1e300, "b": "expected"}}, "the initial gradient is not finite"),
    ],
)
def test_bad_config_values_are_refused_before_any_file(tmp_path, capsys, change, message):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(merged(TINY_EXPERIMENT, change)))
    out = tmp_path / "out"
    refused_in_process(["run", tmp_path / "bad.yaml", "--out", out], capsys, message)
    assert not out.exists()
    out.mkdir()
    (out / "a.h5").write_text(MINE)
    (out / "unshifted.h5").write_text(MINE)
    before = files_under(tmp_path)
    refused_in_process(["run", tmp_path / "bad.yaml", "--out", out, "--overwrite"], capsys, message)
    assert files_under(tmp_path) == before


def test_a_key_given_twice_is_refused(tmp_path, capsys):
    # YAML keeps the last silently: the second `record:` would drop the first's keys.
    (tmp_path / "twice.yaml").write_text("steps: 4\nrecord: {hessian_top_k: 0}\nrecord: {}\n")
    refused_in_process(
        ["run", tmp_path / "twice.yaml", "--out", tmp_path / "out"],
        capsys,
        "key 'record' is given twice in one mapping (line 3)",
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# dynamics run: a failure removes what the run created; every output is locked up front


def test_a_failed_run_removes_what_it_created_and_nothing_else(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(
        yaml.safe_dump(merged(TINY_EXPERIMENT, {"steps": 4, "eval_every": 2}))
    )
    train = runner._train_variant

    def second_fails(experiment, config, name, *args):
        if name == "shifted":
            raise RuntimeError("a failure in training")
        return train(experiment, config, name, *args)

    monkeypatch.setattr(runner, "_train_variant", second_fails)
    out = tmp_path / "new" / "runs"
    argv = ["run", tmp_path / "tiny.yaml", "--out", out, "--no-progress"]
    with pytest.raises(RuntimeError, match="a failure in training"):
        main([str(a) for a in argv])
    assert not (tmp_path / "new").exists()  # unshifted.h5, trained, and the folders: gone
    # A replaced file keeps the failed run's record; a new one is removed; a stranger stays.
    out.mkdir(parents=True)
    (out / "unshifted.h5").write_text(MINE)
    (out / "notes.txt").write_text(MINE)
    with pytest.raises(RuntimeError):
        main([str(a) for a in [*argv, "--overwrite"]])
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "unshifted.h5"]
    assert (out / "unshifted.h5").read_bytes() != MINE.encode()  # replaced, as asked
    monkeypatch.setattr(runner, "_train_variant", train)
    assert main([str(a) for a in [*argv, "--overwrite"]]) == 0  # the retry is not refused
    capsys.readouterr()


def test_every_output_is_locked_before_the_first_variant_trains(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = RunLock.acquire(out / "shifted.h5")  # another run writes the second variant
    try:
        refused_in_process(
            ["run", tmp_path / "tiny.yaml", "--out", out, "--no-progress"],
            capsys,
            "is being written by another run",
        )
        assert sorted(p.name for p in out.iterdir()) == ["shifted.h5.lock"]
    finally:
        elsewhere.release()


# ---------------------------------------------------------------------------------------------
# dynamics plane: options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--span", "-1"], "--span must be a number from 0 to 100.0, got -1.0"),
        (["--span", "-0.6"], "--span must be a number from 0 to 100.0"),
        (["--span", "nan"], "--span must be a number from 0 to 100.0, got nan"),
        (["--span", "inf"], "--span must be a number from 0 to 100.0, got inf"),
        (["--span", "1e308"], "--span must be a number from 0 to 100.0"),
        (["--grid", "100000"], "--grid 100000 needs at least"),
        (["--grid", "1"], "--grid must be at least 2"),
        (["--coarse", "1"], "--coarse must be between 2 and the grid side"),
        (["--processes", "0"], "--processes must be at least 1"),
        (["--processes", "100000"], "--processes must be at least 1 and at most"),
        (["--init-args", "[1]"], "--init-args must be a JSON object"),
    ],
)
def test_bad_plane_options_are_refused_before_any_file(demo, tmp_path, capsys, options, message):
    folder, _ = demo
    runs = [folder / "runs" / f"{v}.h5" for v in ("unshifted", "shifted")]
    (tmp_path / "mine.html").write_text(MINE)
    before = files_under(tmp_path)
    argv = ["plane", *runs, "-o", tmp_path / "mine.html", "--overwrite", *options]
    refused_in_process(argv, capsys, message)
    assert files_under(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# Standard output that goes away or cannot be written


def test_a_reader_that_stops_early_gets_no_traceback(demo):
    folder, _ = demo
    run = folder / "runs" / "unshifted.h5"
    process = subprocess.Popen(
        [DYNAMICS, "info", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()  # as `| head -1` does once it has its line
    _, err = process.communicate(timeout=120)
    assert err == b"" and process.returncode == 141
    shell = subprocess.run(
        ["bash", "-c", f"set -o pipefail; '{DYNAMICS}' info '{run}' --json | head -c 1"],
        capture_output=True,
        text=True,
    )
    assert shell.stdout == "{" and "Traceback" not in shell.stderr, shell.stderr


def test_a_full_device_is_one_line(demo):
    folder, _ = demo
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [DYNAMICS, "info", str(folder / "runs" / "unshifted.h5")],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert_one_line_error(result)
    assert "cannot write the output: No space left on device" in result.stderr


# ---------------------------------------------------------------------------------------------
# A crafted run file: its recorded class is imported only from installed packages, and only a
# torch.nn.Module subclass is called


def crafted(demo, folder: Path, module: dict) -> list[Path]:
    """Both demo runs, copied into ``folder`` with ``module`` as their recorded model."""
    runs = []
    for variant in ("unshifted", "shifted"):
        path = folder / f"{variant}.h5"
        shutil.copy(demo[0] / "runs" / f"{variant}.h5", path)
        with h5py.File(path, "r+") as file:
            file.attrs[names.ATTR_MODULE] = encode_attr(module)
        runs.append(path)
    return runs


def test_a_crafted_module_record_runs_nothing(demo, tmp_path):
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", "MARKER"]}}
    runs = crafted(demo, tmp_path, popen)
    for trust in ([], ["--trust-recorded-model"]):
        result = subprocess.run(
            [DYNAMICS, "plane", *map(str, runs), "-o", "x.html", "--grid", "2", *trust],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert_one_line_error(result)
        assert not (tmp_path / "MARKER").exists()
        assert not (tmp_path / "x.html").exists()
    assert "subprocess.Popen is outside the installed packages" in result.stderr or (
        "not a torch.nn.Module subclass" in result.stderr
    )


@pytest.mark.parametrize(
    ("class_path", "trust", "message"),
    [
        ("evil.Model", False, "evil.Model is outside the installed packages"),
        ("evil.Model", True, "evil.Model is not a torch.nn.Module subclass"),
        ("subprocess.Popen", False, "subprocess.Popen is outside the installed packages"),
        ("subprocess.Popen", True, "subprocess.Popen is not a torch.nn.Module subclass"),
        ("pytorch_lightning.Trainer", False, "Trainer is not a torch.nn.Module subclass"),
        ("dynamics.__main__.Model", True, "names a __main__ module"),
    ],
)
def test_only_installed_modules_classes_are_rebuilt(
    demo, tmp_path, capsys, monkeypatch, class_path, trust, message
):
    # A module of the working directory that leaves a mark when imported.
    (tmp_path / "evil.py").write_text(
        "from pathlib import Path\nPath('IMPORTED').touch()\n\nclass Model:\n    pass\n"
    )
    runs = crafted(demo, tmp_path, {"class_path": class_path, "init_args": {}})
    monkeypatch.chdir(tmp_path)
    argv = ["plane", *runs, "-o", tmp_path / "x.html", "--grid", "2", "--processes", "1"]
    refused_in_process(argv + ["--trust-recorded-model"] * trust, capsys, message)
    # Imported only with the user's word (and even then not called: not a torch.nn.Module).
    assert (tmp_path / "IMPORTED").exists() == (trust and class_path == "evil.Model")
    assert not (tmp_path / "x.html").exists()


def test_an_installed_module_class_is_rebuilt_without_trust(demo, tmp_path, capsys):
    folder, _ = demo
    runs = [folder / "runs" / f"{v}.h5" for v in ("unshifted", "shifted")]
    argv = ["plane", *runs, "-o", tmp_path / "p.html", "--grid", "2", "--processes", "1"]
    assert main([str(a) for a in [*argv, "--no-progress"]]) == 0
    assert (tmp_path / "p.html").exists()
    capsys.readouterr()
