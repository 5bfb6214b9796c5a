"""The README's example runs as written, from an empty folder, and writes only its run file."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    section = README.read_text().split("## Record a run")[1].split("\n## ")[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len([line for line in code.splitlines() if line]) <= 10  # a 10-line example
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    loss, top_eigenvalue = map(float, capsys.readouterr().out.split()[-2:])
    assert loss > 0 and top_eigenvalue > 0  # both read back from the run file
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.h5"]


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 200


def test_every_file_the_readme_links_exists():
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert targets
    missing = [target for target in targets if not (README.parent / target).is_file()]
    assert missing == []
