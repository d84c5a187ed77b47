"""``epgen`` command lines run in this process, for the tests of the command line."""

from __future__ import annotations

from epgen import cli


def run_cli(capsys, *argv):
    """``epgen *argv`` in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err
