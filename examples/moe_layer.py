"""A whole MoE layer's forward on epgen, checked against a dense single-device MoE.

Every rank ``r`` of ``R`` holds ``T`` tokens (hidden size ``H``, BF16); the layer has ``E``
experts, ``L = E / R`` on each rank, each a SwiGLU MLP ``down(silu(gate(x)) * up(x))`` of
width ``I`` (``--ffn-dim``), and routes every token to ``K`` of them:

1. **Router** (per rank, its own tokens): ``logits = x @ W_router`` in float32 ``[T, E]``,
   the ``K`` largest as ``topk_ids`` and the softmax of those ``K`` logits as
   ``topk_weights`` (float32).
2. **Dispatch**: on a GPU ``ep.dispatch(x, topk_ids, topk_weights)`` of an
   ``epgen.torch.EPBuffer`` (torch tensors in, device tensors out, on the current stream,
   no host synchronisation), on the simulator ``world.dispatch(tokens, topk_ids)`` (numpy).
   Destination ``d`` gets every row
   routed to its experts, grouped per local expert: group ``j`` holds rows
   ``[row_offsets[j], row_offsets[j + 1])`` of local expert ``expert_ids[j]`` (global expert
   ``d * L + expert_ids[j]``); the first ``counts[expert].sum()`` of them are the received
   rows, the rest padding (the format's ``expert_m_padding``; BlockwiseFP8 only).
3. **Experts**: each group's received rows through its expert, one batch per expert (what a
   grouped GEMM does); the outputs are BF16, one row per row of the grouped output (padding
   rows zero).
   On a GPU the experts slice the grouped rows by ``row_offsets``, which this example reads
   to the host (one small copy; a grouped GEMM would take the offsets on the device).
4. **Combine**: ``ep.combine(expert_outputs, out)`` (``world.combine(expert_outputs,
   topk_weights)`` on the simulator) sends every row back to the
   source slot ``(t, k)`` it came from (``src_info``) and each source reduces its slots:
   ``out[t] = sum_k w[t, k] * y[t, k]``, fma in float32 in slot order, rounded to BF16.
5. **Check**: a dense MoE on one device with the same weights (every token through its
   ``K`` experts, the weighted sum in float32, no rounding at the end).

**Tolerance.** Per element, ``|out - dense| <= 2^-6 * sum_k |w[t, k] * y[t, k]|`` (``y``:
the dense run's expert outputs). The two results differ by design in three places (BF16
keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it):

- the expert math: with numpy experts (``--backend sim``) it is float32 and the EP path
  rounds each expert output to BF16 before the combine (at most 2^-8 of each term), where
  the dense sum takes the float32 outputs; with torch experts (the GPU) it is BF16 in both
  paths (float32 accumulation inside the GEMMs, BF16 results), but the GEMMs run on
  different batches (a rank's group vs. all tokens of an expert), whose summation order may
  differ, so an output can land on the neighbouring BF16 value (at most 2^-7 of a term);
- the combine's result is rounded to BF16 (at most 2^-8 of ``|out|``, which is at most the
  sum of the terms' magnitudes);
- float32 summation order (fma in slot order vs. the dense sum): about 2^-24 per term.

The worst case is 2^-7 (numpy) and 2^-7 + 2^-8 (torch) of the terms' magnitude; 2^-6 sits
above both. The bound is relative to the terms' magnitude, not to ``|dense|``, because the
``K`` terms can cancel. A wrong expert, a row sent to the wrong slot or a dropped slot
changes an element by a whole term (about ``1/K`` of that magnitude or more) and fails.

The run prints the largest absolute error, the largest relative error (``|out - dense|`` over
the terms' magnitude, the quantity bounded above) and PASS or FAIL; the exit status is 1 on
FAIL, 2 on a usage error or when the mode cannot run here (no torch, no CUDA device).

Modes::

    python examples/moe_layer.py --backend sim        # CPU simulator, numpy experts
    python examples/moe_layer.py                      # one GPU: EmulatedWorld, torch experts
    epgen launch -n 2 -- python examples/moe_layer.py --world shmem --preset small

``--world shmem`` runs one process per rank (``ShmemWorld``): each routes, dispatches,
computes and combines its own tokens and checks them against the dense MoE of its own
tokens (every process draws the same weights from ``--seed``); the launcher's process count
must be the configuration's ``n_ranks``. ``--set n_ranks=N`` sets ``p2p_world_size`` to ``N``
too unless it is set (combine runs over P2P). Tokens of rank ``r`` are drawn from ``(seed,
r)``, so every mode sees the same tokens for the same seed and shape.

The dispatch format (``--set format=...``) may be any the world's combine takes: rows of a
quantising format are dequantised to BF16 before the experts, and the dense MoE runs on the
same round trip of each token through the format; expert outputs are always BF16.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

RTOL = 2.0 ** -6
"""The tolerance, relative to ``sum_k |w[t, k] * y[t, k]|`` (module docstring)."""

PLANTS = ("wrong-expert",)
"""Errors ``--plant`` can put into the EP path to show that the check fails."""


class CannotRun(Exception):
    """What this machine lacks for the mode asked (torch, a CUDA device): exit status 2."""


# ---- configuration -------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="moe_layer.py", description="A whole MoE layer's forward (router, dispatch, "
        "SwiGLU experts, combine) on epgen, compared with a dense single-device MoE.")
    p.add_argument("--backend", choices=("cuda", "sim"), default="cuda",
                   help="cuda: on a GPU, experts in torch (the default); sim: the CPU "
                        "simulator, experts in numpy (no GPU or torch needed)")
    p.add_argument("--world", choices=("emulated", "shmem"), default="emulated",
                   help="emulated: every rank in this process (EmulatedWorld, the default); "
                        "shmem: this process is one rank (ShmemWorld), started by "
                        "'epgen launch -n N --'")
    p.add_argument("--experts", choices=("numpy", "torch"),
                   help="where the router and experts run: numpy (float32, the default with "
                        "--backend sim) or torch (BF16; on the GPU with --backend cuda, the "
                        "default there; on the CPU with --backend sim)")
    p.add_argument("--preset", metavar="NAME",
                   help="configuration preset (default: small with --backend sim, decode on "
                        "a GPU)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", dest="sets", default=[],
                   help="override one parameter of the preset (repeatable), as in 'epgen run'")
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens per rank (default: max_tokens_per_rank)")
    p.add_argument("--ffn-dim", type=int, metavar="I",
                   help="width of each expert's MLP (default: min(hid_dim // 2, 256))")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and tokens (default 0)")
    p.add_argument("--plant", choices=PLANTS,
                   help="testing: plant an error in the EP path (wrong-expert: rank 0's first "
                        "expert with rows runs with the next expert's weights); must FAIL")
    args = p.parse_args(argv)
    args.parser = p
    if args.experts is None:
        args.experts = "numpy" if args.backend == "sim" else "torch"
    if args.backend == "sim" and args.world == "shmem":
        p.error("argument --world shmem: one process per GPU rank (not with --backend sim)")
    return args


def make_config(args):
    """The ``EPConfig`` of ``--preset`` and ``--set`` (a usage error names the bad one)."""
    from epgen import presets

    p = args.parser
    name = args.preset or ("small" if args.backend == "sim" else "decode")
    if name not in presets.preset_names():
        p.error(f"argument --preset: unknown preset {name!r} "
                f"(known: {', '.join(presets.preset_names())})")
    overrides = {}
    for item in args.sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            p.error(f"argument --set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key.strip()] = presets.parse_value(key.strip(), text)
        except ValueError as e:
            p.error(f"argument --set {item}: {e}")
    if "n_ranks" in overrides and "p2p_world_size" not in overrides:
        overrides["p2p_world_size"] = overrides["n_ranks"]
    try:
        cfg = presets.config_from_dict(
            presets.with_overrides(presets.preset_data(name), overrides))
    except ValueError as e:
        p.error(f"preset {name}{''.join(' --set ' + s for s in args.sets)}: {e}")
    launched = os.environ.get("WORLD_SIZE")
    if args.world == "shmem" and launched and int(launched) != cfg.n_ranks:
        p.error(f"--world shmem: {launched} processes were launched (WORLD_SIZE) but preset "
                f"{name} has n_ranks={cfg.n_ranks}: launch -n {cfg.n_ranks}, or --set "
                f"n_ranks={launched} (with n_experts / n_sms to match)")
    for flag, why in (("fused_shared_expert", "group 0 would be the shared expert's"),
                      ("skip_a2a", "each device would be its own EP group")):
        if getattr(cfg, flag):
            p.error(f"--set {flag}=true: not taken by this example ({why})")
    from epgen.runtime.combine import check_supported
    try:
        check_supported(cfg)
    except ValueError as e:
        p.error(str(e))
    return cfg


# ---- BF16 helpers ----------------------------------------------------------------------------
def bf16_to_f32(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    from epgen.reference_combine import f32_to_bf16 as cvt
    return cvt(x)


def as_bf16(fmt, rows, scales, input_scale=1.0):
    """Dispatch output rows of format ``fmt`` as the experts' BF16 inputs (uint16 bits):
    BF16 rows as they are, a quantising format's rows dequantised and rounded to BF16."""
    if fmt.name == "BF16":
        return np.asarray(rows, np.uint16)
    return f32_to_bf16(fmt.dequantize(rows, scales, input_scale).astype(np.float32))


def format_round_trip(fmt, tokens, input_scale=1.0):
    """What the experts see of ``tokens`` (BF16 bits) after dispatch in ``fmt``: the dense
    MoE's input, so both paths start from the same values."""
    if fmt.name == "BF16":
        return np.asarray(tokens, np.uint16)
    return as_bf16(fmt, *fmt.quantize(fmt.to_f32(tokens), input_scale), input_scale)


def expert_groups(cfg, res):
    """``(global expert, first row, end row)`` of each non-empty group of a destination's
    dispatch result: group ``j``'s received rows are the first ``counts[e].sum()`` rows from
    ``row_offsets[j]``, local expert ``e = expert_ids[j]``."""
    L = cfg.layout.n_local_experts
    per_expert = np.asarray(res.counts, np.int64).sum(axis=1)
    out = []
    for j in range(res.n_groups):
        e = int(res.expert_ids[j])
        start, n = int(res.row_offsets[j]), int(per_expert[e])
        if n:
            out.append((res.rank * L + e, start, start + n))
    return out


# ---- experts ---------------------------------------------------------------------------------
class NumpyExperts:
    """Router and SwiGLU experts in float32 numpy (weights drawn from ``seed``)."""

    name = "numpy float32 experts"

    def __init__(self, E, H, I, K, seed):
        rng = np.random.default_rng([seed, 1])
        f32 = np.float32
        self.K = K
        self.router = (rng.standard_normal((H, E), f32) * f32(H ** -0.5))
        self.gate = rng.standard_normal((E, H, I), f32) * f32(H ** -0.5)
        self.up = rng.standard_normal((E, H, I), f32) * f32(H ** -0.5)
        self.down = rng.standard_normal((E, I, H), f32) * f32(I ** -0.5)

    def mlp(self, e, x):
        g = x @ self.gate[e]
        with np.errstate(over="ignore"):
            h = g / (np.float32(1) + np.exp(-g)) * (x @ self.up[e])
        return h @ self.down[e]

    def route(self, x_bits):
        logits = bf16_to_f32(x_bits) @ self.router
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :self.K]
        top = np.take_along_axis(logits, ids, axis=1)
        w = np.exp(top - top.max(axis=1, keepdims=True))
        return ids.astype(np.int32), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)

    def grouped(self, rows_bits, groups, swap=None):
        """BF16 outputs of ``rows_bits`` for ``groups`` (``expert_groups``), other rows zero;
        ``swap``: ``{expert: expert whose weights it runs with}`` (``--plant``)."""
        y = np.zeros(rows_bits.shape, np.uint16)
        x = bf16_to_f32(rows_bits)
        for e, a, b in groups:
            y[a:b] = f32_to_bf16(self.mlp((swap or {}).get(e, e), x[a:b]))
        return y

    def dense(self, x_bits, ids, w):
        """``(out, magnitude)``: ``sum_k w y`` and ``sum_k |w y|`` in float32 ``[N, H]``."""
        x = bf16_to_f32(x_bits)
        out = np.zeros(x.shape, np.float32)
        mag = np.zeros(x.shape, np.float32)
        for e in np.unique(ids):
            t, k = np.nonzero(ids == e)           # t is unique: ids are unique per token
            term = w[t, k, None] * self.mlp(int(e), x[t])
            out[t] += term
            mag[t] += np.abs(term)
        return out, mag


def require_torch(device: str):
    """The torch module, with a CUDA device when ``device`` is one; ``CannotRun`` saying
    what is missing otherwise."""
    try:
        import torch
    except ImportError as e:
        raise CannotRun(f"--experts torch (the default on a GPU) needs torch, which is not "
                        f"installed ({e}): pip install torch, or run --backend sim (numpy "
                        f"experts on the CPU simulator)") from e
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CannotRun("torch sees no CUDA device: run on a GPU, or with --backend sim")
    return torch


class TorchExperts:
    """Router (float32) and SwiGLU experts (BF16 weights and activations, float32
    accumulation) in torch on ``device``, weights drawn on the device from ``seed``."""

    name = "torch BF16 experts"

    def __init__(self, E, H, I, K, seed, device):
        torch = require_torch(device)
        import torch.nn.functional as F

        self.torch, self.F, self.K, self.device = torch, F, K, device
        g = torch.Generator(device=device).manual_seed(seed)
        bf = torch.bfloat16

        def draw(shape, scale, dtype):
            return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

        self.router = draw((H, E), H ** -0.5, torch.float32)
        self.gate = draw((E, H, I), H ** -0.5, bf)
        self.up = draw((E, H, I), H ** -0.5, bf)
        self.down = draw((E, I, H), I ** -0.5, bf)

    def _to(self, bits):
        t = self.torch.from_numpy(np.ascontiguousarray(bits, np.uint16).view(np.int16))
        return t.to(self.device).view(self.torch.bfloat16)

    def mlp(self, e, x):
        return (self.F.silu(x @ self.gate[e]) * (x @ self.up[e])) @ self.down[e]

    def route_device(self, x):
        """``(topk_ids int64, topk_weights float32)`` of BF16 tokens ``x``, on the device."""
        torch = self.torch
        top, ids = torch.topk(x.float() @ self.router, self.K, dim=1)
        return ids, torch.softmax(top, dim=1)

    def route(self, x_bits):
        ids, w = self.route_device(self._to(x_bits))
        return ids.to(self.torch.int32).cpu().numpy(), w.cpu().numpy().astype(np.float32)

    def grouped_device(self, x, groups, swap=None):
        """BF16 outputs of the device rows ``x`` for ``groups`` (other rows zero)."""
        y = self.torch.zeros_like(x)
        for e, a, b in groups:
            y[a:b] = self.mlp((swap or {}).get(e, e), x[a:b])
        return y

    def grouped(self, rows_bits, groups, swap=None):
        y = self.grouped_device(self._to(rows_bits), groups, swap)
        return y.view(self.torch.int16).cpu().numpy().view(np.uint16)

    def dense(self, x_bits, ids, w):
        torch = self.torch
        x = self._to(x_bits)
        ids_d = torch.from_numpy(np.ascontiguousarray(ids)).to(self.device)
        w_d = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(self.device)
        out = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
        mag = torch.zeros_like(out)
        for e in torch.unique(ids_d).tolist():
            t, k = torch.nonzero(ids_d == e, as_tuple=True)
            term = w_d[t, k, None] * self.mlp(e, x[t]).float()
            out.index_add_(0, t, term)
            mag.index_add_(0, t, term.abs())
        return out.cpu().numpy(), mag.cpu().numpy()


EXPERTS = {"numpy": NumpyExperts, "torch": TorchExperts}


# ---- the check -------------------------------------------------------------------------------
def compare(got_bits, dense, mag, rtol=RTOL):
    """``(max abs error, max relative error, ok)`` of the combined BF16 output against the
    dense float32 output: relative to the terms' magnitude ``mag`` (module docstring); an
    element with ``mag == 0`` must be exact."""
    got = bf16_to_f32(got_bits).astype(np.float64)
    err = np.abs(got - dense.astype(np.float64))
    if err.size == 0:
        return 0.0, 0.0, True
    mag = mag.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(mag > 0, err / mag, np.where(err > 0, np.inf, 0.0))
    ok = bool(np.all(np.isfinite(got)) and np.all(err <= rtol * mag))
    return float(err.max()), float(rel.max()), ok


def verdict(label, max_abs, max_rel, ok):
    print(f"{label}: max abs error {max_abs:.3e}, max rel error {max_rel:.3e} "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    return ok


TOLERANCE_NOTE = (
    f"check per element: |out - dense| <= 2^{int(np.log2(RTOL))} * sum_k |w[t,k] y[t,k]| "
    f"(rel error: |out - dense| over that sum). Why not exact: the EP path's expert outputs "
    f"and combined output are BF16 (8 significant bits, 2^-8 per rounding) where the dense "
    f"sum is float32, the expert GEMMs (BF16 with torch, float32 with numpy) run on other "
    f"batches, and the float32 sums run in another order.")


# ---- the layer -------------------------------------------------------------------------------
def rank_tokens(seed, r, T, H):
    from epgen import routing
    return routing.random_tokens(np.random.default_rng([seed, r]), T, H)


def planted_swap(plant, rank, groups, E):
    """``{expert: other}`` for ``--plant wrong-expert`` on rank 0 (else nothing)."""
    if plant != "wrong-expert" or rank != 0 or not groups:
        return None
    e = groups[0][0]
    return {e: (e + 1) % E}


def experts_of(args, cfg, device="cuda"):
    """The router and experts ``--experts`` names; torch's on ``device`` (the CPU under
    ``--backend sim``)."""
    fmt = cfg.token_fmt
    shape = (cfg.n_experts, fmt.hid_dim, args.ffn_dim, fmt.top_k, args.seed)
    if args.experts == "numpy":
        return NumpyExperts(*shape)
    return TorchExperts(*shape, device="cpu" if args.backend == "sim" else device)


def device_groups(cfg, out):
    """``expert_groups`` of a ``DispatchOutput``: its ``row_offsets``, ``expert_ids`` and
    per-expert received counts copied to the host (the one host read of the GPU path)."""
    L = cfg.layout.n_local_experts
    offsets = out.row_offsets.view(out.expert_ids.dtype).cpu().numpy().view(np.uint32)
    ids = out.expert_ids.cpu().numpy()
    per_expert = out.counts.sum(dim=1).cpu().numpy().astype(np.int64)
    groups = []
    for j in range(len(ids)):
        e, start = int(ids[j]), int(offsets[j])
        if per_expert[e]:
            groups.append((out.rank * L + e, start, start + int(per_expert[e])))
    return groups


def torch_layer(args, cfg, ep, experts, tokens, input_scale):
    """The GPU path through ``epgen.torch.EPBuffer`` ``ep`` (every rank it handles): route,
    dispatch, experts and combine on device tensors. Returns the combined outputs (BF16
    bits), ids and weights per rank, on the host for the check."""
    torch, fmt = experts.torch, cfg.token_fmt
    x = [experts._to(t) for t in tokens]
    routes = [experts.route_device(t) for t in x]
    outs = ep.dispatch(x, [i for i, _ in routes], [w for _, w in routes])
    ys = []
    for out in outs:
        groups = device_groups(cfg, out)
        if fmt.name == "BF16":
            rows = out.tokens
        else:   # no device dequantiser here: the format's rows go through the host
            res = out.to_reference(cfg)
            host = np.zeros((cfg.layout.max_out_rows, fmt.hid_dim), np.uint16)
            host[:len(res.out_tokens)] = as_bf16(fmt, res.out_tokens, res.out_scales,
                                                 input_scale)
            rows = experts._to(host)        # one row per row of out.tokens, as combine takes
        ys.append(experts.grouped_device(
            rows, groups, planted_swap(args.plant, out.rank, groups, cfg.n_experts)))
    combined = ep.combine(ys, outs)
    bits = [c.view(torch.int16).cpu().numpy().view(np.uint16) for c in combined]
    return (bits, [i.to(torch.int32).cpu().numpy() for i, _ in routes],
            [w.cpu().numpy().astype(np.float32) for _, w in routes])


def run_emulated(args, cfg, T):
    """Every rank in this process: ``EmulatedWorld`` on the GPU (through the torch API) or
    the CPU simulator (the numpy API)."""
    import epgen

    fmt = cfg.token_fmt
    experts = experts_of(args, cfg)
    world = (epgen.EmulatedWorld(cfg, backend="sim", sim_seed=args.seed)
             if args.backend == "sim" else epgen.EmulatedWorld(cfg))
    tokens = [rank_tokens(args.seed, r, T, fmt.hid_dim) for r in range(cfg.n_ranks)]
    if args.backend == "sim":
        routes = [experts.route(x) for x in tokens]
        ids, weights = [i for i, _ in routes], [w for _, w in routes]
        results = world.dispatch(tokens, ids)
        outputs = []
        for res in results:
            groups = expert_groups(cfg, res)
            rows = as_bf16(fmt, res.out_tokens, res.out_scales, world.input_scale)
            outputs.append(experts.grouped(
                rows, groups, planted_swap(args.plant, res.rank, groups, cfg.n_experts)))
        combined = world.combine(outputs, weights)
    else:
        import epgen.torch
        combined, ids, weights = torch_layer(args, cfg, epgen.torch.EPBuffer(world), experts,
                                             tokens, world.input_scale)
    x = np.concatenate([format_round_trip(fmt, t, world.input_scale) for t in tokens])
    dense, mag = experts.dense(x, np.concatenate(ids), np.concatenate(weights))
    print(TOLERANCE_NOTE)
    for r in range(cfg.n_ranks):
        sl = slice(r * T, (r + 1) * T)
        verdict(f"rank {r}", *compare(combined[r], dense[sl], mag[sl]))
    return verdict(f"all {cfg.n_ranks} ranks", *compare(np.concatenate(combined), dense, mag))


def run_shmem(args, cfg, T):
    """This process's rank of a ``ShmemWorld``: its own tokens, results and check; the
    experts on the world's GPU."""
    import epgen

    fmt = cfg.token_fmt
    with epgen.ShmemWorld(cfg) as world:
        r = world.rank
        experts = experts_of(args, cfg, device=f"cuda:{world.device_id}")
        x = rank_tokens(args.seed, r, T, fmt.hid_dim)
        if isinstance(experts, TorchExperts):
            import epgen.torch
            (combined,), (ids,), (w,) = torch_layer(args, cfg, epgen.torch.EPBuffer(world),
                                                    experts, [x], world.input_scale)
        else:
            ids, w = experts.route(x)
            res = world.dispatch(x, ids)
            groups = expert_groups(cfg, res)
            rows = as_bf16(fmt, res.out_tokens, res.out_scales, world.input_scale)
            y = experts.grouped(rows, groups, planted_swap(args.plant, r, groups,
                                                           cfg.n_experts))
            combined = world.combine(y, w)
        dense, mag = experts.dense(format_round_trip(fmt, x, world.input_scale), ids, w)
        if r == 0:
            print(TOLERANCE_NOTE)
        return verdict(f"rank {r}", *compare(combined, dense, mag))


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    fmt = cfg.token_fmt
    T = cfg.max_tokens_per_rank if args.tokens is None else args.tokens
    if not 0 <= T <= cfg.max_tokens_per_rank:
        args.parser.error(f"argument --tokens: must be in [0, max_tokens_per_rank="
                          f"{cfg.max_tokens_per_rank}], got {T}")
    if args.ffn_dim is None:
        args.ffn_dim = min(fmt.hid_dim // 2, 256)
    if args.ffn_dim < 1:
        args.parser.error(f"argument --ffn-dim: must be >= 1, got {args.ffn_dim}")
    if args.experts == "torch":
        try:
            require_torch("cpu" if args.backend == "sim" else "cuda")
        except CannotRun as e:
            print(f"moe_layer.py: error: {e}", file=sys.stderr)
            return 2
    where = ("the CPU simulator" if args.backend == "sim" else
             "one process per rank (ShmemWorld)" if args.world == "shmem" else
             "one GPU (EmulatedWorld)")
    print(f"MoE layer on {where}: R={cfg.n_ranks} E={cfg.n_experts} H={fmt.hid_dim} "
          f"K={fmt.top_k} I={args.ffn_dim} T={T}/rank, dispatch {fmt.name}, "
          f"{EXPERTS[args.experts].name}, "
          f"seed {args.seed}" + (f", planted error {args.plant}" if args.plant else ""),
          flush=True)
    run = run_shmem if args.world == "shmem" else run_emulated
    return 0 if run(args, cfg, T) else 1


if __name__ == "__main__":
    sys.exit(main())
