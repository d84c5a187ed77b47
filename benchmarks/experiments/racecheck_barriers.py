"""Does compute-sanitizer racecheck follow named barriers? Four 256-thread kernels: groups of
64 threads run a loop of their own named barrier (id 4 + group), then thread 0 writes shared
words, bar.sync 0, every thread reads them (twice). Under racecheck a correct kernel shows no
hazard. A: per-group branches (what epgen emits), group g looping (g + 1) * n times; B: the
barrier id in a register; C: A plus a CTA barrier after the loops; D: A with equal trip counts;
E: group g looping (3 - g) * n times (group 3 never reaches its barrier); F: E plus C's barrier;
G: E plus one more barrier of each group after its loop.
Run: compute-sanitizer --tool racecheck python3 benchmarks/experiments/racecheck_barriers.py K"""
import sys

import numpy as np

import backends.cuda as bc

HEAD = """.version 8.0
.target sm_90
.address_size 64
.shared .align 16 .b8 vals[16];
.visible .entry k(.param .u64 out, .param .u32 n)
{
  .reg .b32 %r<20>; .reg .pred %p<10>; .reg .b64 %rd<10>;
  mov.u32 %r1, %tid.x;
  shr.u32 %r2, %r1, 6;
  ld.param.u32 %r9, [n];
  TRIPS
  mov.u32 %r4, 0;
LOOP:
  setp.ge.u32 %p1, %r4, %r3;
  @%p1 bra DONE;
  BARRIERS
  add.u32 %r4, %r4, 1;
  bra LOOP;
DONE:
  AFTER
  mov.u32 %r10, 0;
ROUND:
  setp.ne.u32 %p5, %r1, 0;
  @%p5 bra SKIP;
  add.u32 %r11, %r10, 7;
  st.shared.u32 [vals+4], %r11;
  st.shared.u32 [vals+8], %r10;
SKIP:
  bar.sync 0;
  ld.shared.u32 %r5, [vals+4];
  ld.shared.u32 %r6, [vals+8];
  add.u32 %r5, %r5, %r6;
  bar.sync 0;
  add.u32 %r10, %r10, 1;
  setp.lt.u32 %p6, %r10, 2;
  @%p6 bra ROUND;
  ld.param.u64 %rd1, [out];
  cvta.to.global.u64 %rd1, %rd1;
  mul.wide.u32 %rd2, %r1, 4;
  add.u64 %rd1, %rd1, %rd2;
  st.global.u32 [%rd1], %r5;
  ret;
}
"""
BRANCHES = "\n".join(f"""  setp.ne.u32 %p2, %r2, {g};
  @%p2 bra NB{g};
  bar.sync {4 + g}, 64;
NB{g}:""" for g in range(4))
UNEQUAL = "add.u32 %r3, %r2, 1;\n  mul.lo.u32 %r3, %r3, %r9;"
DESCENDING = "sub.u32 %r3, 3, %r2;\n  mul.lo.u32 %r3, %r3, %r9;"
KERNELS = {
    "A": (UNEQUAL, BRANCHES, ""),
    "B": (UNEQUAL, "add.u32 %r7, %r2, 4;\n  bar.sync %r7, 64;", ""),
    "C": (UNEQUAL, BRANCHES, "bar.sync 0;"),
    "D": ("mov.u32 %r3, %r9;", BRANCHES, ""),
    "E": (DESCENDING, BRANCHES, ""),
    "F": (DESCENDING, BRANCHES, "bar.sync 0;"),
    "G": (DESCENDING, BRANCHES, BRANCHES.replace("NB", "NA")),
}


def main() -> None:
    trips, barriers, after = KERNELS[sys.argv[1]]
    ptx = HEAD.replace("TRIPS", trips).replace("BARRIERS", barriers).replace("AFTER", after)
    kernel = bc.LoadedModule(ptx).kernel("k", param_types=("ptr.global", "u32"))
    out = bc.zeros(256, np.uint32)
    kernel.launch(2, 256, (out, np.uint32(3)), sync=True)
    got = out.to_host()
    assert (got == 9).all(), got
    print(sys.argv[1], "ok")


if __name__ == "__main__":
    main()
