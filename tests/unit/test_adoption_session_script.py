"""``benchmarks/adoption_session.sh``: every ``epgen bench`` command it runs parses into a
``Plan`` with the bench's own parser and checks (``test_bench.bench_args``: the variants'
specs, ``tune.*`` fields, combine arms and shapes), so a typo costs no GPU minutes; and the
script's modes are the ones its usage line names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_bench import bench_args

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "adoption_session.sh"


def bench_commands(text: str, out: str = "OUT") -> list[list[str]]:
    """The argument lists after ``-m epgen bench`` of every command in ``text`` (continued
    lines joined; ``$OUT`` replaced by ``out``)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        if "-m epgen bench" not in line:
            continue
        argv = shlex.split(line.split("-m epgen bench", 1)[1].replace("$OUT", out))
        unknown = [a for a in argv if "$" in a]
        if unknown:
            raise ValueError(f"a bench command uses shell variables {unknown}: write its "
                             f"arguments out, so that this test can parse them")
        found.append(argv)
    return found


COMMANDS = bench_commands(SCRIPT.read_text())


def test_the_script_has_bench_commands():
    assert len(COMMANDS) >= 4
    assert any("tune.combine_fp8_partial_send_warps_per_row:1" in " ".join(a)
               for a in COMMANDS)


@pytest.mark.parametrize("i", range(len(COMMANDS)),
                         ids=[" ".join(a[:4]) for a in COMMANDS])
def test_every_bench_command_parses(i, tmp_path):
    argv = bench_commands(SCRIPT.read_text(), str(tmp_path))[i]
    plan = bench_args(*argv)
    assert plan.variants


def test_the_usage_names_every_mode():
    text = SCRIPT.read_text()
    modes = re.findall(r"^(\w+)\)$", text, flags=re.M)
    usage = re.search(r"usage: \$0 \[([\w|]+)\]", text).group(1).split("|")
    assert modes == usage
