"""What a new user of issue 23's surfaces hit: each test is one bug found by trying them."""

from __future__ import annotations

import pytest

from dynamics.cli.common import error_line
from dynamics.errors import DynamicsError
from dynamics.store.writer import RunWriter


def test_an_existing_output_names_the_parameter_in_python_and_the_flag_on_the_command_line(
    tmp_path,
):
    from dynamics.analysis.output import check_output

    existing = tmp_path / "run.h5"
    existing.write_bytes(b"a user's file")
    for refuse in (lambda: RunWriter.check_path(existing), lambda: check_output(existing, False)):
        with pytest.raises(DynamicsError) as caught:
            refuse()
        assert "--overwrite" not in str(caught.value)
        assert str(caught.value).endswith("exists; pass overwrite to replace it")
        assert error_line(caught.value).endswith("exists; pass --overwrite to replace it")
    assert existing.read_bytes() == b"a user's file"
