"""``epgen.torch`` without a GPU: it refuses a simulator world, and its input checks name the
input and the rule (CPU tensors, shapes, dtypes) before anything is enqueued."""

from __future__ import annotations

import pytest

from epgen.errors import EPInputError
from epgen.presets import load_preset
from epgen.runtime.world import EmulatedWorld

torch = pytest.importorskip("torch")


def test_a_simulator_world_is_refused():
    from epgen.torch import EPBuffer
    with pytest.raises(ValueError, match="CPU simulator"):
        EPBuffer(EmulatedWorld(load_preset("small"), backend="sim"))


def test_input_checks_name_the_input():
    from epgen.torch import tensors
    cfg = load_preset("small")
    H = cfg.token_fmt.hid_dim
    with pytest.raises(EPInputError, match=r"x\[1\]: a CPU tensor"):
        tensors.tokens_input(torch, torch.zeros(4, H, dtype=torch.bfloat16), "x[1]", cfg, 0)
    with pytest.raises(EPInputError, match=r"topk_ids\[0\]: a CPU tensor"):
        tensors.ids_input(torch, torch.zeros(4, 2, dtype=torch.int64), "topk_ids[0]", 4, 2, 0)
    with pytest.raises(EPInputError, match=r"w\[0\]: a CPU tensor"):
        tensors.weights_input(torch, torch.zeros(4, 2), "w[0]", 4, 2, 0)
