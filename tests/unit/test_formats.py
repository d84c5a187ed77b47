"""Token formats: message layout and sizes (the reference's message layout), numpy pack/unpack, validation."""

import attrs
import ml_dtypes
import numpy as np
import pytest

from epgen import BF16Format, TokenFormat


@pytest.mark.parametrize("H,K,A,token,src_off,topk_off,msg", [
    (7168, 8, 16, 14336, 14336, 14352, 14368),   # the reference's table: BF16 H=7168 K=8
    (3584, 8, 16, 7168, 7168, 7184, 7200),       # the reference tests' H
    (2048, 8, 16, 4096, 4096, 4112, 4128),
    (128, 4, 16, 256, 256, 272, 288),
    (8, 1, 16, 16, 16, 32, 48),
    (8, 9, 16, 16, 16, 32, 64),                  # 18 bytes of ids -> a 32-byte field
    (7168, 32, 16, 14336, 14336, 14352, 14416),
    (24, 8, 32, 64, 64, 96, 128),                # A = 32 pads every field to 32 bytes
])
def test_message_layout(H, K, A, token, src_off, topk_off, msg):
    f = BF16Format(hid_dim=H, top_k=K, alignment=A)
    # msg_size = token_size + align_up(4, A) + align_up(2K, A)
    assert (f.token_size, f.src_info_offset, f.topk_info_offset, f.msg_size()) == \
        (token, src_off, topk_off, msg)
    assert f.msg_size() % 16 == 0 and f.token_size % A == 0


def test_bf16_members():
    f = BF16Format(7168, 8)
    assert (f.hid_dim, f.top_k, f.alignment) == (7168, 8, 16)
    assert f.dispatch_wait_tile_shape == (128, 1) and f.dispatch_smem_size == 0
    assert f.expert_m_padding == 1 and f.name == "BF16"
    assert f.input_dtype == "bf16" and f.out_dtype == "bf16" and f.out_scales is None
    assert f.out_row_shape == (7168,) and f.host_dtype == np.uint16
    assert f.input_row_bytes == 2 * 7168
    assert f.type_name == "BF16_H7168_K8_A16"
    assert isinstance(f, TokenFormat)
    d = f.describe()
    assert d["msg_size"] == 14368 and d["topk_info_offset"] == 14352
    assert f == BF16Format(hid_dim=7168, top_k=8) and hash(f) == hash(BF16Format(7168, 8))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        f.hid_dim = 8


@pytest.mark.parametrize("kwargs,name", [
    (dict(hid_dim=7, top_k=8), "hid_dim"),
    (dict(hid_dim=12, top_k=8), "hid_dim"),       # 24 bytes: not whole 16-byte vectors
    (dict(hid_dim=0, top_k=8), "hid_dim"),
    (dict(hid_dim=-8, top_k=8), "hid_dim"),
    (dict(hid_dim=8.0, top_k=8), "hid_dim"),
    (dict(hid_dim=8, top_k=0), "top_k"),
    (dict(hid_dim=8, top_k=True), "top_k"),
    (dict(hid_dim=8, top_k=2, alignment=8), "alignment"),
    (dict(hid_dim=8, top_k=2, alignment=24), "alignment"),
])
def test_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BF16Format(**kwargs)


def test_pack_unpack_round_trip_and_byte_layout(seed):
    rng = np.random.default_rng(seed)
    for H, K in [(8, 1), (128, 4), (7168, 8), (64, 9)]:
        f = BF16Format(H, K)
        tok = rng.integers(0, 1 << 16, H, dtype=np.uint16)
        src = int(rng.integers(0, 2**31))
        ids = rng.permutation(65536)[:K].astype(np.int32)
        msg = f.pack_message(tok, src, ids)
        assert msg.dtype == np.uint8 and msg.shape == (f.msg_size(),), f"seed={seed}"
        # payload: the bf16 bits, little-endian, then zero padding up to token_size
        assert (msg[:2 * H] == tok.astype("<u2").view(np.uint8)).all(), f"seed={seed}"
        assert (msg[2 * H:f.token_size] == 0).all(), f"seed={seed}"
        so, ko = f.src_info_offset, f.topk_info_offset
        assert int.from_bytes(msg[so:so + 4].tobytes(), "little", signed=True) == src
        assert (msg[so + 4:ko] == 0).all()
        for k in range(K):
            assert int.from_bytes(msg[ko + 2 * k:ko + 2 * k + 2].tobytes(), "little") == ids[k]
        assert (msg[ko + 2 * K:] == 0).all()
        back, back_src, back_ids = f.unpack_message(msg)
        assert (back == tok).all() and back_src == src and (back_ids == ids).all(), \
            f"seed={seed}"


def test_pack_accepts_ml_dtypes_bfloat16():
    f = BF16Format(16, 2)
    x = np.linspace(-3, 3, 16).astype(ml_dtypes.bfloat16)
    msg = f.pack_message(x, 7, [3, 1])
    tok, src, ids = f.unpack_message(msg)
    assert (tok == x.view(np.uint16)).all() and src == 7 and list(ids) == [3, 1]
    with pytest.raises(ValueError, match="bfloat16"):
        f.pack_message(x.astype(np.float32), 0, [0, 1])


def test_batched_pack_unpack(seed):
    rng = np.random.default_rng(seed)
    f = BF16Format(64, 3)
    T = 17
    toks = rng.integers(0, 1 << 16, (T, 64), dtype=np.uint16)
    ids = np.argsort(rng.random((T, 300)), axis=1)[:, :3]
    msgs = f.pack_messages(toks, np.arange(T), ids)
    assert msgs.shape == (T, f.msg_size())
    rows, scales, src, back_ids = f.unpack_messages(msgs)
    assert scales is None
    assert (rows == toks).all() and (src == np.arange(T)).all() and (back_ids == ids).all(), \
        f"seed={seed}"
    assert f.pack_messages(toks[:0], [], ids[:0]).shape == (0, f.msg_size())


def test_pack_rejects_ids_that_do_not_fit_uint16():
    f = BF16Format(8, 2)
    with pytest.raises(ValueError, match="uint16"):
        f.pack_message(np.zeros(8, np.uint16), 0, [0, 65536])
    with pytest.raises(ValueError, match="uint16"):
        f.pack_message(np.zeros(8, np.uint16), 0, [-1, 3])


def test_pad_row_offsets():
    f = BF16Format(8, 2)
    assert list(f.pad_row_offsets([3, 0, 5])) == [0, 3, 3, 8]

    @attrs.frozen
    class Padded(BF16Format):
        expert_m_padding = 4

    # the reference's pad_expert_offsets docstring example
    assert list(Padded(8, 2).pad_row_offsets([10, 10, 10, 10])) == [0, 12, 24, 36, 48]
    assert list(Padded(8, 2).pad_row_offsets([0, 1, 4])) == [0, 0, 4, 8]
    assert Padded(8, 2).pad_row_offsets([]).dtype == np.uint32


def test_device_steps_are_extension_points():
    class Bare(TokenFormat):
        token_size = 16

    with pytest.raises(NotImplementedError, match="Bare.emit_copy_token_to_send_buf"):
        Bare(8, 2).emit_send()
    with pytest.raises(NotImplementedError, match="Bare.emit_copy_msg_to_output"):
        Bare(8, 2).emit_receive()


def test_block_staged_broadcast_preference():
    """The send policy's format property (measured on the H200): the block-staged broadcast
    for BF16, MXFP8 and BlockwiseFP8 at prefill, the warp send path for NVFP4."""
    from epgen.formats import format_class, format_names
    prefer = {n for n in format_names() if format_class(n).prefers_block_staged_broadcast}
    assert prefer == {"BF16", "MXFP8", "BlockwiseFP8"}


def test_codec_and_emitter_parts():
    """A format composes its host codec and device emitter; the parts read its layout."""
    from epgen.formats import DeviceEmitter, HostCodec, format_names, make_format
    for name in format_names():
        f = make_format(name, 512, 4)
        assert isinstance(f.codec, HostCodec) and f.codec.fmt is f
        assert isinstance(f.emitter, DeviceEmitter) and f.emitter.fmt is f
        assert f == make_format(name, 512, 4) and hash(f) == hash(make_format(name, 512, 4))


def test_import_and_ptx_do_not_load_ml_dtypes():
    """``ml_dtypes`` (over a second to import) is for the host codecs only, on first use."""
    import subprocess
    import sys
    code = ("import sys, epgen; from epgen.presets import load_preset; "
            "from epgen.formats import make_format; cfg = load_preset('default'); "
            "f = cfg.token_fmt; "
            "cfg = cfg.replace(token_fmt=make_format('NVFP4', f.hid_dim, f.top_k)); "
            "epgen.emit_ptx(cfg); print('ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
