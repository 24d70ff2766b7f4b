"""The command itself: fast help, a current man page, the tiny command."""

import subprocess
import sys

from conftest import ROOT, h3gen


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from h3gen.cli.main import app; "
            "r = CliRunner().invoke(app, ['render', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_man_page_is_current_and_renders():
    from h3gen.cli.manpage import page

    committed = (ROOT / "man" / "h3gen.1").read_text()
    assert committed == page(), "man/h3gen.1 is stale: run `make man`"
    shown = subprocess.run(["man", "-l", str(ROOT / "man" / "h3gen.1")], capture_output=True, text=True,
                           env={"MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat", "PATH": "/usr/bin:/bin"})
    assert shown.returncode == 0, shown.stderr
    assert "h3gen render" in shown.stdout and "EXIT STATUS" in shown.stdout


def test_tiny_writes_the_model_where_asked(tmp_path):
    result = h3gen("tiny", tmp_path / "tiny", check_code=0)
    assert result.stdout.strip() == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "transformer" / "config.json").is_file()
    assert "smoke-test model" in result.stderr


def test_version():
    assert h3gen("--version", check_code=0).stdout.startswith("h3gen ")
