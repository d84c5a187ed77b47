"""The variant matrix (``epgen/variants.py``): every combination of the
boolean flags of ``EPConfig`` with ``use_shmem=False``.

- every legal combination builds (``epgen.build_module``), verifies (``ir.verify``), emits PTX,
  passes the PTX checker and assembles with ptxas for sm_90 (each distinct PTX once; skipped
  without ptxas unless CI is set, then it fails);
- every illegal combination raises a ``ValueError`` whose message names each flag of each rule
  it breaks, and it breaks exactly the rules written out below (independently of
  ``epgen/config.py``);
- the number of legal combinations is the hand count below.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import pytest

import epgen
import golden_util
import ir
from backends import nvptx
from epgen import presets, variants
from epgen.config import BOOL_PARAMS, EPConfig
from epgen.ep_goldens import FLAG_VARIANTS, flag_variant_config

ARCH = "sm_90"

# Written out by hand, not read from epgen: a new flag makes test_matrix_flags fail until it is
# added here, to RULES (if it conflicts with another flag) and to the hand count.
FLAGS = ("fused_shared_expert", "skip_a2a", "has_rank_flag", "ep_ord_r", "ep_final_layout",
         "ep_prod_reserve", "ep_copy_role_split", "ep_send_join_named", "ep_rank_mask",
         "ep_rank_dedup")

# The flag rules of EPConfig (the reference's plus ours, docs/flags.md, docs/final-layout.md,
# docs/fused.md): (the parameters the rule names, when it is broken). The skip_a2a rules on
# n_ranks and use_shmem never fire here: the matrix builds skip_a2a with n_ranks = 1 and every
# combination with use_shmem = False.
RULES = (
    (("has_rank_flag", "ep_ord_r"), lambda f: f["has_rank_flag"] != f["ep_ord_r"]),
    (("ep_prod_reserve", "ep_final_layout"),
     lambda f: f["ep_prod_reserve"] and not f["ep_final_layout"]),
    (("ep_ord_r", "ep_final_layout", "ep_prod_reserve"),
     lambda f: f["ep_final_layout"] and not f["ep_prod_reserve"] and f["ep_ord_r"]),
    (("ep_final_layout", "fused_shared_expert"),
     lambda f: f["ep_final_layout"] and f["fused_shared_expert"]),
    (("ep_final_layout", "skip_a2a"), lambda f: f["ep_final_layout"] and f["skip_a2a"]),
    # ours: the rank mask takes neither a device without peers, nor ORD-R's per-rank flags,
    # nor the prod reservation's cross-rank waits, nor the shared expert's fused kernel
    (("ep_rank_mask", "skip_a2a"), lambda f: f["ep_rank_mask"] and f["skip_a2a"]),
    (("ep_rank_mask", "ep_ord_r"), lambda f: f["ep_rank_mask"] and f["ep_ord_r"]),
    (("ep_rank_mask", "ep_prod_reserve"), lambda f: f["ep_rank_mask"] and f["ep_prod_reserve"]),
    (("ep_rank_mask", "fused_shared_expert"),
     lambda f: f["ep_rank_mask"] and f["fused_shared_expert"]),
    # ours: the per-rank deduplicated dispatch needs a receive pass (not the final layout)
    # and a link to save (not skip_a2a)
    (("ep_rank_dedup", "ep_final_layout"), lambda f: f["ep_rank_dedup"] and f["ep_final_layout"]),
    (("ep_rank_dedup", "skip_a2a"), lambda f: f["ep_rank_dedup"] and f["skip_a2a"]),
)

# The hand count. has_rank_flag == ep_ord_r, so the pair is one bit "O" (off/on);
# ep_prod_reserve needs ep_final_layout, so (ep_final_layout, ep_prod_reserve) is one of
# (off, off), (on, off), (on, on):
#   (off, off): fused_shared_expert, skip_a2a and O free                     2 * 2 * 2 = 8
#   (on, off):  no fused_shared_expert, no skip_a2a, and O off (ORD-R with
#               the capacity-strided final layout needs ep_prod_reserve)    1
#   (on, on):   no fused_shared_expert, no skip_a2a, O free                 2
# 8 + 1 + 2 = 11 settings of the six protocol flags without ep_rank_mask; with it only those
# without fused_shared_expert, skip_a2a, O and ep_prod_reserve: (off, off) and (on, off), 2.
# ep_copy_role_split and ep_send_join_named conflict with nothing (x 4): (11 + 2) * 4 = 52
# without ep_rank_dedup. With it, only those with (off, off) and no skip_a2a: without the mask
# fused_shared_expert and O free (4), with it 1: (4 + 1) * 4 = 20. 52 + 20 = 72 legal of
# 2**10 = 1024, so 952 illegal.
LEGAL_COUNT = 72
TOTAL = 2 ** len(FLAGS)

COMBOS = variants.combinations()
LEGAL = [c for c in COMBOS if c.legal]
ILLEGAL = [c for c in COMBOS if not c.legal]


def _flags(c) -> dict[str, bool]:
    return {f: f in c.flags for f in FLAGS}


def _broken(c) -> set[frozenset]:
    """The rules (as sets of parameter names) combination ``c`` breaks, per RULES."""
    f = _flags(c)
    return {frozenset(params) for params, broken in RULES if broken(f)}


# ---- the matrix itself -------------------------------------------------------------------
def test_matrix_flags():
    assert set(variants.MATRIX_FLAGS) == set(FLAGS)
    assert variants.FIXED == {"use_shmem": False}
    # every boolean parameter of EPConfig is in BOOL_PARAMS (so a new flag joins the matrix)
    bools = {f.name for f in attrs.fields(EPConfig) if isinstance(f.default, bool)}
    assert bools == set(BOOL_PARAMS) == set(FLAGS) | {"use_shmem"}


def test_every_combination_once():
    assert len(COMBOS) == TOTAL
    assert len({c.flags for c in COMBOS}) == TOTAL
    assert COMBOS[0].flags == () and COMBOS[0].name == "stock"


def test_legal_count_is_the_hand_count():
    assert len(LEGAL) == LEGAL_COUNT
    assert len(ILLEGAL) == TOTAL - LEGAL_COUNT == 952


def test_classification_matches_the_rules():
    """A combination is illegal exactly when it breaks one of RULES, and EPConfig reports
    exactly those rules (no rule on the base parameters: the base reaches every legal one)."""
    for c in COMBOS:
        reported = {frozenset(p) for p in variants.violated_flags(c)}
        assert reported == _broken(c), c.name
        assert c.legal == (not _broken(c)), c.name


def test_base_per_combination():
    """Every combination is built with use_shmem=False; skip_a2a ones per device (n_ranks =
    p2p_world_size = 1, the skip_a2a golden's 8 experts); ep_copy_role_split ones on the
    geometry that enables the split (the role_split golden's)."""
    for c in LEGAL:
        cfg = c.config
        assert not cfg.use_shmem
        assert {f for f in FLAGS if getattr(cfg, f)} == set(c.flags)
        if cfg.skip_a2a:
            assert (cfg.n_ranks, cfg.p2p_world_size, cfg.n_experts) == (1, 1, 8)
        else:
            assert (cfg.n_ranks, cfg.p2p_world_size, cfg.n_experts) == (2, 2, 16)
        if cfg.ep_copy_role_split:
            assert cfg.layout.role_split.enabled, c.name
            assert (cfg.num_threads, cfg.token_fmt.hid_dim) == (384, 6144)


def test_flag_goldens_are_points_of_the_matrix():
    """Each flag golden (ep/<name> of FLAG_VARIANTS) is the matrix's combination of its flags,
    parameter for parameter; a variant that also names a token format (not a matrix
    dimension) is that combination in that format."""
    import attrs
    for name, (_preset, changes) in FLAG_VARIANTS.items():
        flags = [k for k, v in changes.items() if k in FLAGS and v]
        c = variants.combination(flags)
        assert c.legal, name
        golden = flag_variant_config(name)
        if "format" in changes:
            assert golden.token_fmt.name == changes["format"], name
            golden = attrs.evolve(golden, token_fmt=c.config.token_fmt)
        assert c.config == golden, name


def test_cli_args_select_the_combination():
    from epgen.cli import build_parser
    from epgen.commands.common import config_from_args
    for c in LEGAL:
        args = build_parser().parse_args(["ptx", *c.cli_args()])
        cfg, _ = config_from_args(args)
        assert cfg == c.config, c.name


# ---- illegal combinations ------------------------------------------------------------------
@pytest.mark.parametrize("c", ILLEGAL, ids=[c.name for c in ILLEGAL])
def test_illegal_combination_names_the_conflicting_flags(c):
    """EPConfig raises a ValueError; for each broken rule one line of the message names every
    flag of that rule (e.g. has_rank_flag without ep_ord_r, ep_prod_reserve without
    ep_final_layout)."""
    table = {**presets.preset_data(variants.BASE_PRESET), **c.changes}
    with pytest.raises(ValueError) as info:
        presets.config_from_dict(table)
    lines = str(info.value).splitlines()
    broken = _broken(c)
    assert broken
    for rule in broken:
        assert any(all(flag in line for flag in rule) for line in lines), \
            f"no line of the message names all of {sorted(rule)}:\n{info.value}"


# ---- legal combinations --------------------------------------------------------------------
class _Matrix:
    """Builds each legal combination once (module, PTX) and hands each distinct PTX (by hash)
    to ptxas on a worker thread as soon as it is emitted, so ptxas runs on the second core
    while the next combination is built (the build tests run before the assemble tests)."""

    def __init__(self):
        self.ptxas = nvptx.find_ptxas()
        self.pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1))
        self.built: dict[str, tuple] = {}
        self.assembled: dict[str, Future] = {}

    def build(self, name: str):
        if name not in self.built:
            c = next(c for c in LEGAL if c.name == name)
            module = epgen.build_module(c.config)
            ptx = nvptx.emit_ptx(module, arch=ARCH)
            key = hashlib.sha256(ptx.encode()).hexdigest()
            if self.ptxas is not None and key not in self.assembled:
                self.assembled[key] = self.pool.submit(nvptx.assemble, ptx, arch=ARCH)
            self.built[name] = (module, ptx, key)
        return self.built[name]


@pytest.fixture(scope="module")
def matrix():
    m = _Matrix()
    yield m
    m.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", [c.name for c in LEGAL])
def test_legal_combination_builds_verifies_and_checks(matrix, name):
    module, ptx, _ = matrix.build(name)
    ir.verify(module)
    for kernel in module.kernels:
        assert f".entry {kernel.name}(" in ptx
    nvptx.check_ptx(module, ptx)


@pytest.mark.parametrize("name", [c.name for c in LEGAL])
def test_legal_combination_assembles(matrix, name):
    if matrix.ptxas is None:
        message = "ptxas not found (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel)"
        if golden_util.is_ci():
            pytest.fail(f"{message}; CI must assemble every legal combination", pytrace=False)
        pytest.skip(message)
    module, _, key = matrix.build(name)
    report = matrix.assembled[key].result()
    assert {k.name for k in module.kernels} <= set(report.kernels), report.log


# ---- combine -------------------------------------------------------------------------------
def test_combine_builds_where_supported_and_is_refused_elsewhere():
    """For every legal combination: where ``runtime.combine.check_supported`` accepts it the
    combine module builds, verifies, emits PTX that passes the checker and (with ptxas)
    assembles (each distinct PTX once); elsewhere ``build_combine_module`` refuses it with a
    ``ValueError``. At least the stock combination builds."""
    from epgen.kernels import build_combine_module
    exe = nvptx.find_ptxas()
    seen, built = set(), 0
    for c in LEGAL:
        if c.combine_error is not None:
            with pytest.raises(ValueError):
                build_combine_module(c.config)
            continue
        module = build_combine_module(c.config)
        ir.verify(module)
        ptx = nvptx.emit_ptx(module, arch=ARCH)
        for kernel in module.kernels:
            assert f".entry {kernel.name}(" in ptx, c.name
        nvptx.check_ptx(module, ptx)
        built += 1
        key = hashlib.sha256(ptx.encode()).hexdigest()
        if exe is not None and key not in seen:
            seen.add(key)
            report = nvptx.assemble(ptx, arch=ARCH)
            assert {k.name for k in module.kernels} <= set(report.kernels), report.log
    assert built >= 1 and variants.combination([]).combine_error is None


def test_named_variants_combine_builds_where_supported():
    """Every registered variant with a configuration (``variants.variant_config``): where
    ``epgen variants`` says ``[combine: yes]`` the combine module builds, verifies and its PTX
    passes the checker; elsewhere ``build_combine_module`` refuses it."""
    from epgen import goldens
    from epgen.kernels import build_combine_module
    named = [n for n in goldens.names() if variants.variant_config(n) is not None]
    assert {"ep/small", "ep/default", "ep/final_layout", "combine/small"} <= set(named)
    assert variants.variant_config("ep/default_nvfp4").token_fmt.name == "NVFP4"
    assert variants.variant_config("ep/fused_se").fused_shared_expert
    assert variants.variant_config("ep/shmem_mixed") == flag_variant_config("shmem_mixed")
    assert variants.variant_config("demo/copy16") is None
    built = set()
    for name in named:
        cfg = variants.variant_config(name)
        if repr(cfg) in built:       # an FP8 twin's configuration is its BF16 golden's
            continue
        built.add(repr(cfg))
        if variants.combine_error(cfg) is not None:
            with pytest.raises(ValueError):
                build_combine_module(cfg)
            continue
        module = build_combine_module(cfg)
        ir.verify(module)
        nvptx.check_ptx(module, nvptx.emit_ptx(module, arch=ARCH))
