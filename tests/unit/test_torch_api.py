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


class _FakeLaunch:
    """A prepared launch's parameter slots (``PreparedLaunch.params`` / ``slot``)."""

    def __init__(self, *names):
        import numpy as np
        self.params = frozenset(names)
        self.slots = {n: np.zeros(1, np.uint64) for n in names}

    def slot(self, name):
        return self.slots[name]


def test_hot_params_write_each_value_to_every_launch_that_takes_it_under_its_name():
    """A call's values reach every launch of the rank that takes them, under the launch's
    own parameter name (the id check of every rank names rank 2's ``ids_in_2``), and a slot
    is written only when its value changed."""
    from epgen.torch.buffer import _HotParams
    send, wait = _FakeLaunch("input_tokens", "ids_in", "n_tokens"), _FakeLaunch("n_tokens")
    check_all = _FakeLaunch("ids_in_1", "n_tokens_1", "ids_in_2", "n_tokens_2")
    hot = _HotParams([(send, {}), (wait, {}),
                      (check_all, {"ids_in": "ids_in_2", "n_tokens": "n_tokens_2"})],
                     ("input_tokens", "ids_in", "n_tokens", "ids_wide"))
    assert set(hot.slots) == {"input_tokens", "ids_in", "n_tokens"}   # no launch takes ids_wide
    hot.write({"input_tokens": 7, "ids_in": 11, "n_tokens": 5, "ids_wide": 1})
    assert [int(send.slots[n][0]) for n in ("input_tokens", "ids_in", "n_tokens")] == [7, 11, 5]
    assert int(wait.slots["n_tokens"][0]) == 5
    assert int(check_all.slots["ids_in_2"][0]) == 11 and int(check_all.slots["n_tokens_2"][0]) == 5
    assert int(check_all.slots["ids_in_1"][0]) == 0      # another rank's parameter: untouched
    send.slots["ids_in"][0] = 99                          # only a changed value is rewritten
    hot.write({"input_tokens": 7, "ids_in": 11, "n_tokens": 6, "ids_wide": 1})
    assert int(send.slots["ids_in"][0]) == 99 and int(wait.slots["n_tokens"][0]) == 6
