"""The command line as a package: its public parser, and library parameter errors printed with
the flag the user typed (``FLAG_OF``), also when a library wrapper quotes them."""

import pickle
import subprocess
import sys

import pytest

from dynamics.cli import build_parser, main
from dynamics.cli.common import FLAG_OF, error_line
from dynamics.errors import DynamicsError, ParameterError


def every_flag() -> set[str]:
    commands = build_parser()._subparsers._group_actions[0].choices
    return {flag for parser in commands.values() for flag in parser._option_string_actions}


def test_build_parser_holds_every_command():
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {
        "run",
        "sweep",
        "configs",
        "reproduce",
        "info",
        "plane",
        "report",
        "compare",
        "overshoot",
        "audit",
        "watch",
        "spectra",
    }
    args = build_parser().parse_args(["plane", "a.h5", "b.h5", "-o", "p.html", "--grid", "3"])
    assert args.grid == 3 and args.handler.__module__ == "dynamics.cli.plane"


def test_every_flag_of_the_table_is_a_flag_of_some_command():
    assert set(FLAG_OF.values()) <= every_flag()


def test_a_parameter_error_is_printed_with_its_flag(capsys, monkeypatch):
    def refuse(args):
        raise ParameterError("grid_side", "must be at least 2, got 1")

    monkeypatch.setattr("dynamics.cli.info.handle", refuse)  # the parser takes it when built
    assert main(["info", "x.h5"]) == 2
    assert capsys.readouterr().err == "dynamics: error: --grid must be at least 2, got 1\n"


def test_parameters_a_message_quotes_are_spelled_as_their_flags():
    def wrapped() -> DynamicsError:
        try:
            raise ParameterError("model", "m:M: no such file m.py")
        except ParameterError as error:
            try:
                raise DynamicsError(f"a.h5: {error}; the other run stored its views") from None
            except DynamicsError as outer:
                return outer

    assert (
        error_line(wrapped())
        == "a.h5: --model m:M: no such file m.py; the other run stored its views"
    )
    model = ParameterError("model", "path/to/file.py:Net")
    trust = ParameterError("trust_recorded_model", "if you trust this file")
    advice = DynamicsError(
        f"a.h5: outside the installed packages; name it with {model}, or pass {trust}"
    )
    assert error_line(advice.quoting(model, trust)) == (
        "a.h5: outside the installed packages; name it with --model path/to/file.py:Net, "
        "or pass --trust-recorded-model if you trust this file"
    )
    # a parameter no flag feeds keeps the library's name
    assert error_line(ParameterError("dtype", "must be floating")) == "dtype must be floating"
    assert error_line(DynamicsError("plain")) == "plain"


def test_parameter_errors_and_errors_quoting_them_pickle():
    model = ParameterError("model", "path/to/file.py:Net")
    advice = pickle.loads(pickle.dumps(DynamicsError(f"pass {model}").quoting(model)))
    assert error_line(advice) == "pass --model path/to/file.py:Net"
    (quoted,) = advice.quoted
    assert (quoted.parameter, quoted.problem, str(quoted)) == ("model", model.problem, str(model))


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"]])
def test_python_m_dynamics_cli_is_the_command(argv):
    result = subprocess.run(
        [sys.executable, "-m", "dynamics.cli", *argv], capture_output=True, text=True
    )
    assert result.returncode == 0 and "usage: dynamics" in result.stdout


def test_the_audit_target_is_not_spelled_as_model(tmp_path, capsys):
    # build_module's refusal names its model parameter; audit's target is no --model flag.
    missing = tmp_path / "nope.py"
    assert main(["audit", f"{missing}:Net"]) == 2
    assert capsys.readouterr().err == f"dynamics: error: {missing}:Net: no such file {missing}\n"


@pytest.mark.parametrize("points", [1, -3, 1002])
def test_barrier_points_are_checked_once_before_any_file_is_read(tmp_path, capsys, points):
    from dynamics.analysis.pages.run_comparison import write_comparison
    from dynamics.errors import ParameterError

    missing = [tmp_path / "a.h5", tmp_path / "b.h5"]  # never opened: the check comes first
    with pytest.raises(
        ParameterError, match=f"^barrier_points must be 0 or from 2 to 1001, got {points}$"
    ):
        write_comparison(missing, tmp_path / "c.html", barrier_points=points)
    for path in missing:
        path.write_bytes(b"")
    argv = ["compare", *map(str, missing), "-o", str(tmp_path / "c.html")]
    assert main([*argv, "--barrier-points", str(points)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"--barrier-points must be 0 or from 2 to 1001, got {points}")
    )
    assert not (tmp_path / "c.html").exists()
