"""``backends.nvptx.normalize`` (PTX registers and labels renumbered per function) and
``epgen diff --normalize``."""

from __future__ import annotations

import difflib
import re

from backends.nvptx.normalize import comparable_lines, normalize_ptx
from epgen import cli

PTX = """\
.version 8.6
.target sm_90
.visible .entry k0(
\t.param .u64 k0_param_0
)
{
\t.reg .pred \t%p<9>;
\t.reg .b32 \t%r<40>;
\t.reg .b64 \t%rd<30>;
\tld.param.b64 \t%rd17, [k0_param_0];
\tmov.u32 \t%r12, %tid.x;
\tsetp.eq.s32 \t%p8, %r12, 0;
\t@%p8 bra \t$L__BB0_7;
\tadd.s32 \t%r31, %r12, %r12;
\tst.global.u32 \t[%rd17], %r31;
$L__BB0_7:
\tmov.u64 \t%rd3, %globaltimer;
\tmov.u64 \t%rd4, %clock64;
\tret;
}
.func k1()
{
\t.reg .b32 \t%r<20>;
\tmov.u32 \t%r19, %ctaid.x;
\tadd.s32 \t%r7, %r19, 1;
$L__BB1_3:
\tbra.uni \t$L__BB1_3;
}
"""


def test_renumbers_per_function_and_class_in_order_of_first_appearance():
    out = normalize_ptx(PTX)
    k0, k1 = out.split(".func k1()")
    assert "ld.param.b64 \t%rd1, [k0_param_0];" in k0
    assert "mov.u32 \t%r1, %tid.x;" in k0
    assert "setp.eq.s32 \t%p1, %r1, 0;" in k0
    assert "add.s32 \t%r2, %r1, %r1;" in k0
    assert "st.global.u32 \t[%rd1], %r2;" in k0
    assert "@%p1 bra \t$L__BB0_1;" in k0 and "\n$L__BB0_1:\n" in k0
    # special registers are not virtual registers
    assert "mov.u64 \t%rd2, %globaltimer;" in k0 and "mov.u64 \t%rd3, %clock64;" in k0
    # declarations keep their counts
    assert ".reg .b32 \t%r<40>;" in k0 and ".reg .pred \t%p<9>;" in k0
    # the second function starts again at 1
    assert "mov.u32 \t%r1, %ctaid.x;" in k1 and "add.s32 \t%r2, %r1, 1;" in k1
    assert "\n$L__BB1_1:\n\tbra.uni \t$L__BB1_1;" in k1
    assert normalize_ptx(out) == out


def test_renamed_registers_normalise_to_the_same_text():
    renamed = re.sub(r"%r(\d+)\b", lambda m: f"%r{int(m.group(1)) + 100}", PTX)
    renamed = renamed.replace("$L__BB0_7", "$L__BB0_2")
    assert renamed != PTX
    assert normalize_ptx(renamed) == normalize_ptx(PTX)
    # a real change still shows
    changed = renamed.replace("add.s32 \t%r131", "sub.s32 \t%r131")
    diff = [x for x in difflib.unified_diff(comparable_lines(PTX), comparable_lines(changed))
            if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    assert diff == ["-\tadd.s32 \t%r2, %r1, %r1;\n", "+\tsub.s32 \t%r2, %r1, %r1;\n"]


def test_an_inserted_instruction_is_the_whole_masked_diff():
    # one more register early on renumbers every later one, but the comparison is by the
    # masked line: the diff is the insertion alone
    lines = PTX.splitlines(keepends=True)
    at = lines.index("\tmov.u32 \t%r12, %tid.x;\n")
    inserted = "".join(lines[:at] + ["\tmov.u32 \t%r2, %laneid;\n"] + lines[at:])
    diff = [x for x in difflib.unified_diff(comparable_lines(PTX), comparable_lines(inserted))
            if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    assert diff == ["+\tmov.u32 \t%r1, %laneid;\n"]


def _run(capsys, *argv) -> tuple[int, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert status in (0, 1), err
    return status, out


def test_cli_diff_normalize_send_join_named(capsys):
    """The flag's diff, normalised, is much shorter than the plain one and still shows the
    barrier change: the warp path's token-group barriers (``bar.sync 4..7, 64`` on the small
    preset) go, the named send join ``bar.sync 3, 256`` comes."""
    status, plain = _run(capsys, "diff", "ep/small", "ep/send_join_named")
    assert status == 1
    status, norm = _run(capsys, "diff", "--normalize", "ep/small", "ep/send_join_named")
    assert status == 1
    assert norm.startswith("--- ep/small.ptx\n+++ ep/send_join_named.ptx\n")
    assert len(norm.splitlines()) * 2 < len(plain.splitlines()), (
        len(norm.splitlines()), len(plain.splitlines()))
    added = [x for x in norm.splitlines() if x.startswith("+") and re.search(r"\bbar\.sync\s", x)]
    removed = [x for x in norm.splitlines() if x.startswith("-") and re.search(r"\bbar\.sync\s", x)]
    assert any(re.search(r"\bbar\.sync\s+3,\s*256;", x) for x in added), added
    assert not any(re.search(r"\bbar\.sync\s+3,", x) for x in removed), removed
    assert any(re.search(r"\bbar\.sync\s+[4-9],\s*\d+;", x) for x in removed), removed
    # the same variant against itself: empty, exit 0
    assert _run(capsys, "diff", "--normalize", "ep/small", "ep/small") == (0, "")
