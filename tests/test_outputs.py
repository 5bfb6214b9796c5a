"""Every output a command writes: beside the target and renamed into place, never through a link,
never onto a special file, an input or a run file; claimed by one process at a time; a full disk
is one line."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest
import yaml

from dynamics.analysis.output import (
    PLANE_GRID_SCHEMA,
    check_output,
    claimed,
    replacing,
    write_atomically,
)
from dynamics.errors import DynamicsError
from tests.conftest import TINY_EXPERIMENT


def _special_files(tmp_path):
    """(name, path) of nodes a page must never replace: a FIFO, a character device (where this
    user may make one), links to a file, to standard output and to nowhere."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    nodes = {}
    os.mkfifo(tmp_path / "fifo")
    nodes["fifo"] = tmp_path / "fifo"
    try:
        os.mknod(tmp_path / "null", 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
        nodes["character device"] = tmp_path / "null"
    except PermissionError:
        pass
    for name, target in (("link", victim), ("stdout link", "/proc/self/fd/1"), ("dangling", "x")):
        (tmp_path / name.replace(" ", "_")).symlink_to(target)
        nodes[name] = tmp_path / name.replace(" ", "_")
    return victim, nodes


def _node(path):
    stat = os.lstat(path)
    return stat.st_mode, stat.st_ino, stat.st_rdev


def test_a_special_file_or_a_link_is_refused_and_left_as_it_was(tmp_path):
    victim, nodes = _special_files(tmp_path)
    for name, path in nodes.items():
        before = _node(path)
        with pytest.raises(DynamicsError) as refused:
            check_output(path, overwrite=True)
        message = str(refused.value)
        assert "\n" not in message and str(path) in message, name
        assert ("symbolic link" if "link" in name or name == "dangling" else "not a regular") in (
            message
        ), name
        with pytest.raises(DynamicsError):  # the writer checks again at the rename
            write_atomically(path, "<html>")
        assert _node(path) == before, name
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim.txt", *(p.name for p in nodes.values())]
    )


def _run_like_file(path):
    with h5py.File(path, "w") as file:
        file.attrs["schema"] = "dynamics-run"
        file["loss"] = np.arange(3.0)
    return path.read_bytes()


def test_a_page_never_replaces_an_hdf5_file_and_a_grid_only_a_grid(tmp_path):
    run = tmp_path / "C.h5"
    before = _run_like_file(run)
    with pytest.raises(DynamicsError, match="HDF5 file .* a page never replaces it"):
        check_output(run, overwrite=True)
    with pytest.raises(DynamicsError, match="not a plane grid .* never replaces it"):
        check_output(run, overwrite=True, kind=PLANE_GRID_SCHEMA)
    text = tmp_path / "notes.h5"
    text.write_text("a user's notes")
    with pytest.raises(DynamicsError, match="not a plane grid"):
        check_output(text, overwrite=True, kind=PLANE_GRID_SCHEMA)
    assert run.read_bytes() == before
    with h5py.File(tmp_path / "old.h5", "w") as file:  # a grid written before grids had a schema
        file.attrs.update(complete=True, remarks="[]")
    with h5py.File(tmp_path / "new.h5", "w") as file:
        file.attrs["schema"] = PLANE_GRID_SCHEMA
    for grid in ("old.h5", "new.h5"):
        assert check_output(tmp_path / grid, True, kind=PLANE_GRID_SCHEMA) == tmp_path / grid
    with pytest.raises(DynamicsError, match="exists; pass overwrite to replace it"):
        check_output(tmp_path / "new.h5", False, kind=PLANE_GRID_SCHEMA)


def test_a_write_goes_through_a_temporary_file_and_cleans_a_killed_writers_leftovers(tmp_path):
    page = tmp_path / "page.html"
    page.write_text("old")
    leftover = tmp_path / ".page.html.k1ll3d_x"  # what a writer killed before its rename leaves
    leftover.write_text("half")
    other = tmp_path / ".page.html.x.abcdefgh"  # page.html.x's, not page.html's
    other.write_text("someone else's")
    with pytest.raises(RuntimeError), replacing(page) as temporary:
        temporary.write_text("half of the new page")
        raise RuntimeError("killed half-way")
    assert page.read_text() == "old" and leftover.exists()
    write_atomically(page, "new")
    assert page.read_text() == "new" and not leftover.exists() and other.exists()
    assert oct(page.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "page.html"]


def test_a_lock_path_holding_another_file_is_refused_and_left_as_it_was(tmp_path):
    """Taking a lock truncates its file: a hard link at ``NAME.lock`` (to a run file) or a
    file of that name (``uv.lock`` for ``-o uv``) must never be taken."""
    victim = tmp_path / "victim.h5"
    victim.write_bytes(b"a run's bytes")
    os.link(victim, tmp_path / "page.html.lock")
    (tmp_path / "uv.lock").write_text("someone's dependencies")
    stale = tmp_path / "old.html.lock"
    stale.write_text("pid 999999 on elsewhere")  # a killed writer's: taken again
    for page, why in (("page.html", "hard link"), ("uv", "not a lock")):
        with pytest.raises(DynamicsError, match=why) as refused:
            write_atomically(tmp_path / page, "new")
        assert "\n" not in str(refused.value) and not (tmp_path / page).exists()
    assert victim.read_bytes() == b"a run's bytes"
    assert (tmp_path / "uv.lock").read_text() == "someone's dependencies"
    write_atomically(tmp_path / "old.html", "new")
    assert (tmp_path / "old.html").read_text() == "new" and not stale.exists()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dynamics.analysis.output import claimed
    with claimed([Path(sys.argv[1])]):
        print("held", flush=True)
        time.sleep(60)
    """
)


@pytest.fixture
def held(tmp_path):
    """A live process that owns ``tmp_path/out.html`` for writing (as a plane does while it
    evaluates): (path, its pid)."""
    out = tmp_path / "out.html"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    yield out, holder.pid
    holder.kill()
    holder.wait()


def test_an_output_another_process_writes_is_refused_in_one_line(held, monkeypatch):
    out, pid = held
    with pytest.raises(DynamicsError) as refused, claimed([out]):
        pass
    assert str(refused.value).startswith(
        f"{out} is being written by another process (pid {pid} on "
    )
    monkeypatch.setattr("dynamics.analysis.output._CLAIM_WAIT_S", 0.2)
    with pytest.raises(DynamicsError, match="being written by another process"):
        write_atomically(out, "mine")
    assert not out.exists()


def test_two_planes_to_one_output_the_second_is_one_line(held, dynamics, one_line_error):
    out, pid = held
    runs = [out.with_name(name) for name in ("a.h5", "b.h5")]
    result = dynamics("plane", *runs, "-o", out, "--overwrite", "--no-progress")
    one_line_error(result)
    assert f"is being written by another process (pid {pid} on " in result.stderr
    assert not out.exists() and not out.with_suffix(".plane.h5").exists()


@pytest.fixture
def demo_copy(demo, tmp_path):
    """The demo's two run files, copied (other tests read the originals)."""
    folder, _ = demo
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("unshifted", "shifted"):
        shutil.copy(folder / "runs" / f"{name}.h5", runs / f"{name}.h5")
    return runs / "unshifted.h5", runs / "shifted.h5"


def test_plane_grids_never_touch_a_run_of_the_pages_name(demo_copy, dynamics, one_line_error):
    unshifted, shifted = demo_copy
    bystander = unshifted.with_name("C.h5")  # an unrelated run named like the page
    shutil.copy(shifted, bystander)
    before = bystander.read_bytes()
    out = bystander.with_suffix(".html")
    args = ("plane", unshifted, shifted, "--grid", "3", "--processes", "1", "--no-progress")
    result = dynamics(*args, "-o", out)
    assert result.returncode == 0, result.stderr
    grid = out.with_suffix(".plane.h5")
    assert f"grids and trajectories in {grid}" in result.stdout
    with h5py.File(grid) as views:
        assert views.attrs["schema"] == PLANE_GRID_SCHEMA and views.attrs["complete"]
    grid.unlink()
    grid.symlink_to(bystander)  # a link planted where the grid goes
    refused = dynamics(*args, "-o", out, "--overwrite")
    one_line_error(refused)
    assert "symbolic link" in refused.stderr and grid.is_symlink()
    assert bystander.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ["C.h5", "C.html", "C.plane.h5", "unshifted.h5", "shifted.h5"]
    )


def test_an_interrupted_plane_keeps_the_previous_complete_grid(demo_copy, tmp_path, monkeypatch):
    from dynamics.analysis.pages.plane import write_plane
    from dynamics.geometry.landscape import LossSurface

    out = tmp_path / "p.html"
    write_plane(*demo_copy, out, grid_side=4, processes=1)
    grid = out.with_suffix(".plane.h5")
    page, complete = out.read_bytes(), grid.read_bytes()
    calls, evaluate = [], LossSurface.losses_on_plane

    def interrupted(self, plane, grid, points):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(points)
        return evaluate(self, plane, grid, points)

    monkeypatch.setattr(LossSurface, "losses_on_plane", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_plane(*demo_copy, out, overwrite=True, grid_side=4, processes=1)
    assert out.read_bytes() == page and grid.read_bytes() == complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.html", "p.plane.h5", "runs"]


def test_run_refuses_a_run_path_that_is_a_link_or_a_device(tmp_path, dynamics, one_line_error):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    out = tmp_path / "runs"
    out.mkdir()
    (out / "shifted.h5").symlink_to("/proc/self/fd/1")
    result = dynamics("run", tmp_path / "tiny.yaml", "--out", out, "--overwrite")
    one_line_error(result)
    assert f"{out / 'shifted.h5'} is a symbolic link" in result.stderr
    assert os.listdir(out) == ["shifted.h5"] and (out / "shifted.h5").is_symlink()


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled up (mounting one needs root: skipped otherwise)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with open(disk / "filler", "wb") as filler, pytest.raises(OSError, match="No space"):
            filler.write(b"x" * 128 * 1024)
            filler.flush()
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_run_on_a_full_disk_is_one_line_and_leaves_nothing(full_disk, tmp_path, dynamics):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    result = dynamics("run", tmp_path / "tiny.yaml", "--out", full_disk / "runs", "--no-progress")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
    assert os.listdir(full_disk) == ["filler"]  # no lock file, no folder left


def test_a_page_on_a_full_disk_is_one_line_and_leaves_the_old_page(full_disk):
    filler, page = full_disk / "filler", full_disk / "page.html"
    os.truncate(filler, filler.stat().st_size - 12 * 1024)  # three pages of 4 KiB free:
    page.write_text("old")  # one for the old page, one for the lock, none for the new page
    with pytest.raises(DynamicsError, match="cannot write .*No space left on device"):
        write_atomically(page, "x" * 64 * 1024)
    assert page.read_text() == "old"
    assert sorted(os.listdir(full_disk)) == ["filler", "page.html"]


def test_a_plane_killed_mid_grid_leaves_the_old_grid_and_the_next_cleans_up(demo_copy, tmp_path):
    from tests.conftest import DYNAMICS

    out = tmp_path / "k.html"
    args = [DYNAMICS, "plane", *map(str, demo_copy), "-o", str(out), "--processes", "1"]
    args += ["--no-progress"]
    first = subprocess.run([*args, "--grid", "3"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    grid = out.with_suffix(".plane.h5")
    page, complete = out.read_bytes(), grid.read_bytes()
    plane = subprocess.Popen([*args, "--grid", "41", "--overwrite"], stderr=subprocess.PIPE)
    while not list(tmp_path.glob(".k.plane.h5.*")):  # its grid is being written
        assert plane.poll() is None, plane.stderr.read()
        time.sleep(0.01)
    plane.kill()
    plane.wait()
    assert out.read_bytes() == page and grid.read_bytes() == complete
    assert len(list(tmp_path.glob(".k.plane.h5.*"))) == 1  # what the kill left
    again = subprocess.run([*args, "--grid", "3", "--overwrite"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.html", "k.plane.h5", "runs"]


def test_report_and_compare_refuse_a_run_file_a_fifo_or_a_link_as_output(
    demo_copy, dynamics, one_line_error
):
    unshifted, shifted = demo_copy
    folder = unshifted.parent
    os.mkfifo(folder / "fifo.html")
    (folder / "out.html").symlink_to("/proc/self/fd/1")
    before = {p: _node(p) for p in folder.iterdir()}
    contents = {p: p.read_bytes() for p in (unshifted, shifted)}
    cases = [
        (["report", unshifted, "-o", shifted], "HDF5 file (a run file?)"),
        (["compare", unshifted, unshifted, "-o", shifted], "HDF5 file (a run file?)"),
        (["report", unshifted, "-o", folder / "fifo.html"], "not a regular file"),
        (["compare", unshifted, shifted, "-o", folder / "out.html"], "symbolic link"),
    ]
    for args, message in cases:
        result = dynamics(*args, "--overwrite")
        one_line_error(result)
        assert message in result.stderr, result.stderr
    assert {p: _node(p) for p in folder.iterdir()} == before
    assert {p: p.read_bytes() for p in (unshifted, shifted)} == contents
