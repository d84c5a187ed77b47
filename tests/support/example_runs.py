"""``examples/moe_layer.py`` run as a script from the repository root, for its tests on the
simulator and on the GPU, and its layer on the reference (the combines' error figures)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np

from epgen import reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "moe_layer.py")


def run_example(args, timeout=300, cmd=None, env=None):
    """The example with ``args`` (or the command ``cmd``), ``PYTHONPATH`` the repository:
    (the completed process, its stdout and stderr as one text)."""
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    proc = subprocess.run(cmd or [sys.executable, SCRIPT, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr


def assert_passes(proc, text, n_ranks=2):
    """The run exited 0 and every one of ``n_ranks`` ranks printed its PASS line."""
    assert proc.returncode == 0, text[-4000:]
    for r in range(n_ranks):
        assert re.search(rf"^(\[rank {r}\] )?rank {r}: max abs error \S+, max rel error \S+ "
                         rf"PASS$", proc.stdout, re.M), text[-4000:]
    assert "FAIL" not in proc.stdout, text[-4000:]


def moe_module():
    """``examples/moe_layer.py`` imported as a module (its numpy experts and router)."""
    spec = importlib.util.spec_from_file_location("moe_layer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def moe_reference_round_trip(cfg, seed: int, intermediate: int = 512):
    """The example's layer on the reference for ``cfg`` (its ranks, experts, hidden size,
    top-k and tokens per rank): each rank's tokens, the example's router and SwiGLU experts,
    the reference dispatch and every received row's expert output:
    ``(results, expert_outputs, weights)``, per rank."""
    moe = moe_module()
    R, E, H = cfg.n_ranks, cfg.n_experts, cfg.token_fmt.hid_dim
    K, T = cfg.token_fmt.top_k, cfg.max_tokens_per_rank
    experts = moe.NumpyExperts(E, H, intermediate, K, seed)
    tokens = [moe.rank_tokens(seed, r, T, H) for r in range(R)]
    routes = [experts.route(x) for x in tokens]
    ids, ws = [i for i, _ in routes], [w for _, w in routes]
    results = reference.dispatch(cfg, tokens, ids)
    ys = [experts.grouped(np.asarray(res.out_tokens, np.uint16), moe.expert_groups(cfg, res))
          for res in results]
    return results, ys, ws
