"""The executable specification (aegis_kernels.reference) against its own docstring.

ChaCha: the RFC 8439 test vectors, an independent ChaCha20 (``cryptography``) on our counter
layout, and a plain-Python ChaCha written here for the 8-round default. Noise: the documented word
layout, stream addressing and Box-Muller in float64. Floods: the rows / matrix formulas, the stats
layouts and the fail-closed edge cases, property tests with hypothesis, and the second moments
(6-sigma bounds from the exact variance, fixed keys). Calibration: statistic / public / batch params.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import aegis_kernels
from aegis_kernels import reference as ref

U32 = 2.0**-24  # unit roundoff of fp32
M32 = 0xFFFFFFFF
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None)
KEY = aegis_kernels.key_from_int(0x243F6A8885A308D313198A2E03707344A4093822299F31D0082EFA98EC4E6C89)


# ----------------------------------------------------------------------------- helpers
def _key_words(key_bytes: bytes) -> torch.Tensor:
    """A 32-byte ChaCha key as our 8 int64 words (RFC 8439: little-endian words)."""
    return torch.tensor(struct.unpack("<8I", key_bytes), dtype=torch.int64)


def _key_bytes(key: torch.Tensor) -> bytes:
    return struct.pack("<8I", *key.tolist())


def _words_bytes(words) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


def _py_chacha(state: list[int], rounds: int) -> list[int]:
    """The ChaCha block function on Python ints, written from RFC 8439 §2.1-2.3 (any even round count)."""
    x = list(state)

    def rotl(v, n):
        return ((v << n) | (v >> (32 - n))) & M32

    def qr(a, b, c, d):
        x[a] = (x[a] + x[b]) & M32
        x[d] = rotl(x[d] ^ x[a], 16)
        x[c] = (x[c] + x[d]) & M32
        x[b] = rotl(x[b] ^ x[c], 12)
        x[a] = (x[a] + x[b]) & M32
        x[d] = rotl(x[d] ^ x[a], 8)
        x[c] = (x[c] + x[d]) & M32
        x[b] = rotl(x[b] ^ x[c], 7)

    for _ in range(rounds // 2):
        qr(0, 4, 8, 12), qr(1, 5, 9, 13), qr(2, 6, 10, 14), qr(3, 7, 11, 15)
        qr(0, 5, 10, 15), qr(1, 6, 11, 12), qr(2, 7, 8, 13), qr(3, 4, 9, 14)
    return [(a + b) & M32 for a, b in zip(x, state)]


def _our_state(key: torch.Tensor, block: int, domain: int) -> list[int]:
    """The documented state: [c0 c1 c2 c3 | k0 .. k7 | b_lo b_hi | domain 0]."""
    block &= 2**64 - 1
    return [*ref.SIGMA_CONSTANTS, *key.tolist(), block & M32, block >> 32, domain, 0]


def _oracle_block(key: torch.Tensor, block: int, domain: int) -> list[int]:
    """One block of our layout through cryptography's ChaCha20 (OpenSSL). Its 16-byte nonce is the
    RFC state's words 12..15 (4-byte little-endian counter, then the 12-byte nonce): here
    [b_lo | b_hi, domain, 0], one block per call so the 32-bit counter never carries."""
    algorithms = pytest.importorskip("cryptography.hazmat.primitives.ciphers.algorithms")
    from cryptography.hazmat.primitives.ciphers import Cipher

    block &= 2**64 - 1
    nonce = struct.pack("<4I", block & M32, block >> 32, domain, 0)
    enc = Cipher(algorithms.ChaCha20(_key_bytes(key), nonce), mode=None).encryptor()
    return list(struct.unpack("<16I", enc.update(bytes(64))))


def _random_keys(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2**32, (8,), generator=gen, dtype=torch.int64) for _ in range(n)]


EDGE_BLOCKS = [0, 1, 2, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 5, 2**63 - 1, 2**63, 2**64 - 1]


def _as_int64(block: int) -> int:
    """A uint64 block counter as the int64 with the same bits (how the stream holds it)."""
    return block - 2**64 if block >= 2**63 else block


# ----------------------------------------------------------------------------- ChaCha
RFC_232_KEY = bytes(range(32))
RFC_232_OUT = [
    0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
    0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
]


def test_rfc8439_block_function_vector():
    """RFC 8439 §2.3.2: key 00..1f, nonce 00000009 0000004a 00000000, block count 1."""
    key = _key_words(RFC_232_KEY)
    state = [*ref.SIGMA_CONSTANTS, *key.tolist(), 1, 0x09000000, 0x4A000000, 0x00000000]
    out = ref.chacha_block(state, 20)
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert out.tolist() == RFC_232_OUT
    assert _py_chacha(state, 20) == RFC_232_OUT  # the plain-Python ChaCha used below is right too


# RFC 8439 Appendix A.1, test vectors #1 and #2 (all-zero key and nonce; block counters 0 and 1)
RFC_A1 = {
    0: "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
       "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586",
    1: "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
       "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f",
}


@pytest.mark.parametrize("block", sorted(RFC_A1))
def test_rfc8439_appendix_a1_keystream_vectors(block):
    """With a zero nonce our layout is the RFC's (b_hi = domain = 0): keystream(rounds=20) is the
    RFC keystream, serialized as little-endian words."""
    zero = torch.zeros(8, dtype=torch.int64)
    words = ref.keystream(zero, torch.tensor([block]), rounds=20)[0].tolist()
    assert _words_bytes(words).hex() == RFC_A1[block]


def test_rfc8439_appendix_a1_vectors_agree_with_the_oracle():
    zero = torch.zeros(8, dtype=torch.int64)
    for block, hexed in RFC_A1.items():
        assert _words_bytes(_oracle_block(zero, block, 0)).hex() == hexed


def test_chacha20_equals_cryptography_on_our_counter_layout():
    """Random keys, 64-bit block counters across 2^32 (and 2^63, 2^64 - 1), both domains."""
    pytest.importorskip("cryptography")
    gen = torch.Generator().manual_seed(11)
    rand_blocks = torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen, dtype=torch.int64).tolist()
    for i, key in enumerate(_random_keys(4, seed=5)):
        blocks = [_as_int64(b) for b in EDGE_BLOCKS] + rand_blocks
        for domain in (ref.NOISE_DOMAIN, ref.DERIVE_DOMAIN, 0xDEADBEEF):
            got = ref.keystream(key, torch.tensor(blocks), domain, rounds=20)
            expect = [_oracle_block(key, b, domain) for b in blocks]
            assert got.tolist() == expect, (i, domain)


def test_chacha_block_takes_tensor_words_and_broadcasts():
    """chacha_block on (n,) tensors of states == n separate blocks (checked at 20 rounds by the oracle)."""
    pytest.importorskip("cryptography")
    keys = _random_keys(6, seed=8)
    gen = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 2**33, (6,), generator=gen, dtype=torch.int64)
    k = torch.stack(keys)  # (6, 8)
    state = [*ref.SIGMA_CONSTANTS, *k.unbind(1), blocks & M32, blocks >> 32, 1, 0]
    out = ref.chacha_block(state, 20)
    assert out.shape == (6, 16)
    for i in range(6):
        assert out[i].tolist() == _oracle_block(keys[i], int(blocks[i]), 1)


def test_eight_round_default():
    """The default ChaCha8 (not checkable against a 20-round oracle): the same code at 20 rounds is
    the oracle (above); at 8 rounds it equals the plain-Python ChaCha8 and differs from ChaCha20."""
    assert ref.ROUNDS == 8
    for key in _random_keys(3, seed=2):
        for block in (0, 1, 2**32 - 1, 2**32, 2**63 - 1):
            state = _our_state(key, block, 0)
            eight = ref.chacha_block(state).tolist()
            assert eight == ref.chacha_block(state, 8).tolist() == _py_chacha(state, 8)
            twenty = ref.chacha_block(state, 20).tolist()
            assert twenty == _py_chacha(state, 20)
            assert sum(a != b for a, b in zip(eight, twenty)) >= 14  # unrelated words, not a tweak
            assert ref.chacha_block(state, 12).tolist() == _py_chacha(state, 12)


@pytest.mark.parametrize("rounds", [0, 6, 7, 9, -2])
def test_bad_round_counts_are_rejected(rounds):
    with pytest.raises(ValueError, match="rounds"):
        ref.chacha_block([0] * 16, rounds)


def test_keystream_is_the_block_function_on_the_documented_state():
    key = _random_keys(1, seed=3)[0]
    blocks = [_as_int64(b) for b in EDGE_BLOCKS]
    for domain in (0, 1):
        got = ref.keystream(key, torch.tensor(blocks), domain)
        assert got.shape == (len(blocks), 16) and got.dtype == torch.int64
        assert ((got >= 0) & (got <= M32)).all()
        for row, b in zip(got.tolist(), blocks):
            assert row == _py_chacha(_our_state(key, b, domain), 8)
    # the default is the noise domain with ROUNDS rounds
    b = torch.tensor(blocks)
    assert torch.equal(ref.keystream(key, b), ref.keystream(key, b, ref.NOISE_DOMAIN, ref.ROUNDS))


def test_keystream_depends_on_every_input():
    key = _random_keys(1, seed=4)[0]
    base = ref.keystream(key, torch.tensor([5]))[0]
    assert not torch.equal(base, ref.keystream(key, torch.tensor([5 + 2**32]))[0])  # high counter word
    assert not torch.equal(base, ref.keystream(key, torch.tensor([6]))[0])
    assert not torch.equal(base, ref.keystream(key, torch.tensor([5]), ref.DERIVE_DOMAIN)[0])
    for i in range(8):
        flipped = key.clone()
        flipped[i] ^= 1 << (i * 3)
        assert not torch.equal(base, ref.keystream(flipped, torch.tensor([5]))[0]), i


# ----------------------------------------------------------------------------- keys
def test_derive_key_is_the_derive_domain_block_of_the_step():
    master = _random_keys(1, seed=6)[0]
    for step in (0, 1, 7, 2**32 - 1, 2**32, 2**62 + 3):
        key = ref.derive_key(master, step)
        assert key.shape == (8,) and key.dtype == torch.int64
        assert key.tolist() == _py_chacha(_our_state(master, step, ref.DERIVE_DOMAIN), 8)[:8]
        assert torch.equal(key, ref.derive_key(master, torch.tensor(step)))
    keys = {tuple(ref.derive_key(master, s).tolist()) for s in range(300)}
    assert len(keys) == 300 and tuple(master.tolist()) not in keys
    # a step key is not the noise stream's first words
    assert ref.derive_key(master, 0).tolist() != ref.keystream(master, torch.tensor([0]))[0, :8].tolist()


def test_new_key_and_key_from_int():
    a, b = ref.new_key(), ref.new_key()
    for k in (a, b):
        assert k.shape == (8,) and k.dtype == torch.int64 and ((k >= 0) & (k <= M32)).all()
    assert not torch.equal(a, b)
    assert aegis_kernels.new_key is ref.new_key and aegis_kernels.key_from_int is ref.key_from_int
    assert ref.key_from_int(7 + (5 << 32) + (3 << 224)).tolist() == [7, 5, 0, 0, 0, 0, 0, 3]
    assert ref.key_from_int(2**256 - 1).tolist() == [M32] * 8
    assert ref.key_from_int(0).tolist() == [0] * 8


@pytest.mark.parametrize("bad", [torch.zeros(8, dtype=torch.int32), torch.zeros(7, dtype=torch.int64),
                                 torch.zeros(2, 8, dtype=torch.int64), 12345])
def test_bad_keys_are_rejected(bad):
    with pytest.raises(ValueError, match="new_key"):
        ref.check_key(bad)
    with pytest.raises(ValueError, match="new_key"):
        ref.noise((4,), bad)


# ----------------------------------------------------------------------------- normals
def test_words_per_element():
    """bf16: one word per element (one Box-Muller normal); fp16 / fp32 / fp64: two (a sum of two)."""
    assert ref.words_per_element(torch.bfloat16) == 1
    assert ref.words_per_element(torch.float16) == ref.words_per_element(torch.float32) == 2
    assert ref.words_per_element(torch.float64) == 2


def _edge_words() -> tuple[torch.Tensor, torch.Tensor]:
    """Radius words at both ends of both halves and of the series branch (v < 2^-10); angle words
    at the signed wrap (2^31), at zero, near +-2^24 (where int -> fp32 starts rounding) and at
    every eighth of the circle; all pairs of those, plus random words."""
    radius = [0, 1, 2**21 - 1, 2**21, 2**21 + 1, 2**30, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 2**21,
              2**32 - 1]
    angle = sorted({o * 2**29 + d for o in range(8) for d in (0, 1, 2**24 - 1, 2**24 + 1)} | {2**32 - 1, 2**32 - 2})
    a = torch.tensor(radius).repeat_interleave(len(angle))
    b = torch.tensor(angle).repeat(len(radius))
    gen = torch.Generator().manual_seed(12)
    ra, rb = (torch.randint(0, 2**32, (20000,), generator=gen, dtype=torch.int64) for _ in range(2))
    return torch.cat([a, ra]), torch.cat([b, rb])


def test_normal_pair_is_the_documented_box_muller():
    """In float64: u = the midpoint of the word's cell of width 2^-32 (a >= 2^31: u = v in (0, 1/2),
    else u = 1 - v), r = sqrt(-2 ln u), theta = (b as int32 + 1/2) 2 pi 2^-32. The fp32 result is
    within a few roundings of the angle (|theta| <= pi: ~2^-22 absolute) and of the radius, except
    that for a < 2^31 and v >= RADIUS_SERIES the log reads 1 - v rounded to fp32: t = r^2 / 2 is
    then off by up to 2^-24 absolute, so r by 2^-24 / r."""
    a, b = _edge_words()
    z0, z1 = ref.normal_pair(a, b)
    assert z0.dtype == z1.dtype == torch.float32
    n = 2.0**32
    ad, bd = a.double(), b.double()
    u = torch.where(a >= 2**31, (ad - 2**31 + 0.5) / n, (n - ad - 0.5) / n)
    r = torch.sqrt(-2 * torch.log(u))
    theta = (torch.where(b >= 2**31, bd - n, bd) + 0.5) * (2 * math.pi / n)
    assert (theta.abs() < math.pi).all()
    rounded_1mv = (a < 2**31) & ((ad + 0.5) / n >= ref.RADIUS_SERIES)
    tol = 16 * U32 * r + torch.where(rounded_1mv, 1.5 * 2.0**-24 / r, 0.0) + 2.0**-60
    assert ((z0.double() - r * torch.cos(theta)).abs() <= tol).all()
    assert ((z1.double() - r * torch.sin(theta)).abs() <= tol).all()
    # the extreme radii: a = 2^31 is the smallest u = 2^-33, a = 0 the largest 1 - 2^-33 (series branch)
    rmax = math.sqrt(-2 * math.log(2.0**-33))
    top = torch.hypot(*ref.normal_pair(torch.tensor([2**31]), torch.tensor([12345])))
    assert abs(top.item() - rmax) <= 4 * U32 * rmax
    low = torch.hypot(*ref.normal_pair(torch.tensor([0]), torch.tensor([12345])))
    assert abs(low.item() - math.sqrt(2 * 2.0**-33)) <= 4 * U32 * low.item()
    # near theta = 0 the sine is resolved relatively: the half-step offset (no angle is 0, and angle
    # words b and -1 - b mirror each other) shows
    small = torch.tensor([0, 1, 1000, 2**20, 2**32 - 1, 2**32 - 2, 2**32 - 1001, 2**32 - 2**20 - 1])
    a = torch.full_like(small, 2**31 + 12345)
    z0, z1 = ref.normal_pair(a, small)
    signed = torch.where(small >= 2**31, small.double() - n, small.double())
    r = torch.sqrt(-2 * torch.log((a.double() - 2**31 + 0.5) / n))
    expect = r * torch.sin((signed + 0.5) * (2 * math.pi / n))
    assert ((z1.double() - expect).abs() <= 8 * U32 * expect.abs()).all()
    assert ((z1[:4] + z1[4:]).abs() <= 4 * U32 * z1[:4].abs()).all() and torch.equal(z0[:4], z0[4:])


def _layout_from_words(key, block0, nblocks, dtype) -> torch.Tensor:
    """noise(...) rebuilt from the docstring: keystream words -> Box-Muller pairs (radius word 2i,
    angle word 2i + 1) -> 16-bit: element pair j = pair j; fp32: element pair j = (pair 2j + pair 2j+1)/sqrt 2."""
    words = ref.keystream(key, block0 + torch.arange(nblocks))
    out = []
    for row in words:
        pairs = [ref.normal_pair(row[2 * i], row[2 * i + 1]) for i in range(8)]
        if ref.words_per_element(dtype) == 2:  # Z = c z_a + c z_b in one fused multiply-add, c = 1/sqrt 2
            c = torch.tensor(ref.INV_SQRT2, dtype=torch.float32)
            pairs = [tuple(ref.fma(c, pairs[2 * j][k], c * pairs[2 * j + 1][k]) for k in range(2)) for j in range(4)]
        out += [z for pair in pairs for z in pair]
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("block0", [0, 3, 2**32 - 2])
def test_noise_is_the_documented_layout_of_the_words(dtype, block0):
    per = ref.words_per_element(dtype)
    n = 3 * 16 // per - 5  # three blocks' worth, the last one partly used
    z = ref.noise((n,), KEY, 16 * block0, dtype)
    assert z.dtype == torch.float32 and z.shape == (n,)
    assert torch.equal(z, _layout_from_words(KEY, block0, 3, dtype)[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_offsets_address_one_word_stream(dtype):
    """A tensor at word offset o holds stream elements o / words_per_element onwards, in shape order."""
    per = ref.words_per_element(dtype)
    whole = ref.noise((400,), KEY, 0, dtype)
    for offset in (16, 48, 160):
        part = ref.noise((5, 7), KEY, offset, dtype)
        assert torch.equal(part.reshape(-1), whole[offset // per : offset // per + 35])
    assert torch.equal(ref.noise((), KEY, 32, dtype), whole[32 // per])
    assert ref.noise((0, 3), KEY, 0, dtype).shape == (0, 3)


def test_noise_chunks_are_seamless(monkeypatch):
    """The reference draws cache-sized chunks of blocks: chunk borders change nothing."""
    expect = {dt: ref.noise((13, 11), KEY, 32, dt) for dt in (torch.float32, torch.float16)}
    monkeypatch.setattr(ref, "_CHUNK_BLOCKS", 3)
    for dt, z in expect.items():
        assert torch.equal(ref.noise((13, 11), KEY, 32, dt), z)


def test_stream_offsets_partition_the_stream_for_mixed_dtypes():
    tensors = [(5, torch.float32), (3, torch.bfloat16), (0, torch.float32), (8, torch.float16), (9, torch.float32),
               (16, torch.bfloat16), (1, torch.float64)]
    offsets = ref.stream_offsets(tensors)
    assert offsets == [0, 16, 32, 32, 48, 80, 96]
    assert aegis_kernels.stream_offsets(tensors) == offsets and ref.stream_offsets([]) == []
    ranges = [(o, o + n * ref.words_per_element(dt)) for o, (n, dt) in zip(offsets, tensors)]
    for i, (lo, hi) in enumerate(ranges):
        assert lo % ref.BLOCK_WORDS == 0
        for lo2, hi2 in ranges[i + 1 :]:
            assert hi <= lo2 or hi2 <= lo  # no word read twice
    # and the floods at those offsets draw different noise from one key
    zs = [ref.noise((n,), KEY, o, dt) for o, (n, dt) in zip(offsets, tensors)]
    assert not torch.equal(zs[0][:5], zs[4][:5])


@pytest.mark.parametrize("offset", [8, 1, -16, 2**40 + 4])
def test_offsets_must_be_block_aligned(offset):
    with pytest.raises(ValueError, match="stream_offsets"):
        ref.noise((4,), KEY, offset)
    with pytest.raises(ValueError, match="stream_offsets"):
        ref.flood(torch.ones(3, 3), "rows", [0.3, 1.0, 1.0, 0.0], KEY, offset)


def test_same_key_same_noise_other_key_or_offset_other_noise():
    a = ref.noise((33, 17), KEY, 16)
    assert torch.equal(a, ref.noise((33, 17), KEY.clone(), 16))
    other_key = KEY.clone()
    other_key[7] ^= 1 << 31
    for b in (ref.noise((33, 17), other_key, 16), ref.noise((33, 17), KEY, 32), ref.noise((33, 17), KEY, 0)):
        assert not torch.isclose(a, b).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noise_is_standard_normal(dtype):
    """Mean, variance, fourth moment and the CDF at 9 points, 6 sigma from their exact variances;
    |z| within the stream's largest radius (sqrt 2 times it for a sum of two)."""
    n = 1 << 17
    z = ref.noise((n,), KEY, 0, dtype).double()
    assert abs(z.mean().item()) <= 6 / math.sqrt(n)
    assert abs(z.pow(2).mean().item() - 1) <= 6 * math.sqrt(2 / n)
    assert abs(z.pow(4).mean().item() - 3) <= 6 * math.sqrt(96 / n)
    for x in (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0):
        p = 0.5 * math.erfc(-x / math.sqrt(2))
        assert abs((z <= x).double().mean().item() - p) <= 6 * math.sqrt(p * (1 - p) / n), x
    rmax = math.sqrt(-2 * math.log(2.0**-33))
    assert z.abs().max().item() <= rmax * (math.sqrt(2) if ref.words_per_element(dtype) == 2 else 1) * (1 + 1e-6)
    # neighbours (the two halves of a pair, and across pairs) are uncorrelated
    for lag in (1, 2, 8):
        r = torch.corrcoef(torch.stack((z[:-lag], z[lag:])))[0, 1].item()
        assert abs(r) <= 6 / math.sqrt(n), lag


def test_streams_of_different_keys_are_uncorrelated():
    n = 1 << 16
    a = ref.noise((n,), ref.key_from_int(1), 0).double()
    b = ref.noise((n,), ref.key_from_int(2), 0).double()
    c = ref.noise((n,), ref.key_from_int(1), 16 * 4096).double()
    for x, y in ((a, b), (a, c)):
        r = torch.corrcoef(torch.stack((x, y)))[0, 1].item()
        assert abs(r) <= 6 / math.sqrt(n - 1)


# ----------------------------------------------------------------------------- floods: formulas
def _grad(v: int, d: int, seed: int, zero_rows: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different norms (log-normal scales), the first ``zero_rows`` rows zero."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(v, d, generator=gen) * torch.exp(1.5 * torch.randn(v, 1, generator=gen))
    g[:zero_rows] = 0
    return g.to(dtype)


def _z(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))


def _not_near(values: torch.Tensor, cut: float) -> bool:
    """No value within a relative 1e-5 of the cut (fp32 and fp64 sides agree), unless exactly on it."""
    close = (values - cut).abs() <= 1e-5 * abs(cut)
    return bool(((~close) | (values == cut)).all())


CLIP_FACTORS = [math.inf, 2.0, 0.7, 0.05]
THR_FACTORS = [0.0, 0.01, 0.3, 0.95]
shapes = st.tuples(st.integers(1, 40), st.integers(1, 24))
flood_params = st.tuples(
    st.floats(0.0, 1.0, width=32, allow_subnormal=False), st.floats(0.0, 4.0, width=32, allow_subnormal=False),
    st.sampled_from(CLIP_FACTORS), st.sampled_from(THR_FACTORS),
    st.integers(0, 10_000),
)


@SETTINGS
@given(shapes, flood_params, st.integers(0, 5))
def test_rows_flood_formula(shape, p, zero_rows):
    """(E1)-(E4), (C): rows outside S are exactly sigma z; rows in S are rho min(1, clip / n_v) g + sigma z;
    stats = [sigma, |S|, |S clipped|, max n_v]."""
    rho, sigma, cf, tf, seed = p
    g = _grad(*shape, seed=seed, zero_rows=min(zero_rows, shape[0]))
    z = _z(shape, seed)
    n64 = torch.linalg.vector_norm(g.double(), dim=1)
    peak = n64.max().item()
    params = torch.tensor([rho, sigma, cf * peak, tf * peak])
    clip, thr = params[2].item(), params[3].item()  # as the flood sees them (fp32)
    assume(_not_near(n64, thr) and (math.isinf(clip) or _not_near(n64, clip)))
    out, stats = ref.flood(g, "rows", params, z=z)
    assert out.dtype == torch.float32 and out.shape == g.shape and stats.shape == (4,)
    active = n64 > thr
    clipped = active & (n64 > clip)
    noise = params[1] * z
    assert torch.equal(out[~active], noise[~active])
    scale = torch.where(clipped, torch.tensor(clip, dtype=torch.float64) / n64, 1.0) * rho
    expect = scale[:, None] * g.double() + sigma * z.double()
    bound = (shape[1] + 6) * U32 * (scale[:, None] * g.double().abs() + (sigma * z.double()).abs()) + 2.0**-126
    assert ((out.double() - expect).abs() <= bound)[active].all()
    assert stats[0].item() == params[1].item()
    assert stats[1].item() == active.sum().item() and stats[2].item() == clipped.sum().item()
    assert abs(stats[3].item() - peak) <= (shape[1] + 2) * U32 * peak
    # (C): the signal of every kept row has norm <= rho clip
    if not math.isinf(clip):
        signal = torch.linalg.vector_norm((out - noise).double(), dim=1)
        slack = 4 * U32 * torch.linalg.vector_norm(noise.double(), dim=1)  # out - noise rounds like out
        assert (signal <= rho * clip * (1 + 4 * shape[1] * U32) + slack)[active].all()


@SETTINGS
@given(st.lists(st.integers(1, 9), min_size=0, max_size=3), flood_params)
def test_matrix_flood_formula(shape, p):
    """(E5), (C): out = rho min(1, clip / ||G||_F) G + sigma Z on any shape; stats = [sigma, ||G||_F, that scale]."""
    rho, sigma, cf, _, seed = p
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen) * math.exp(3 * torch.randn((), generator=gen).item())
    z = _z(shape, seed)
    norm = torch.linalg.vector_norm(g.double()).item()
    params = torch.tensor([rho, sigma, cf * max(norm, 1e-3), 0.5])  # thr is unused by the matrix flood
    clip = params[2].item()
    assume(math.isinf(clip) or abs(norm - clip) > 1e-5 * clip)
    out, stats = ref.flood(g, "matrix", params, z=z)
    assert out.shape == g.shape and stats.shape == (3,)
    scale = rho * (clip / norm if norm > clip else 1.0)
    n = max(g.numel(), 1)
    expect = scale * g.double() + sigma * z.double()
    bound = (math.log2(n) + 8) * U32 * (scale * g.double().abs() + (sigma * z.double()).abs()) + 2.0**-126
    assert ((out.double() - expect).abs() <= bound).all()
    assert stats[0].item() == params[1].item()
    assert abs(stats[1].item() - norm) <= (n + 2) * U32 * norm
    assert abs(stats[2].item() - scale) <= (n + 4) * U32 * scale
    if not math.isinf(clip):
        noise = params[1] * z
        slack = 4 * U32 * torch.linalg.vector_norm(noise.double()).item()  # out - noise rounds like out
        assert torch.linalg.vector_norm((out - noise).double()).item() <= rho * clip * (1 + 1e-5) + slack


@SETTINGS
@given(shapes, flood_params, st.integers(0, 5))
def test_every_row_is_nonzero_with_noise(shape, p, zero_rows):
    """Theorem 2: with sigma > 0 every row of the rows flood is non-zero (the stream's normals never vanish)."""
    rho, sigma, cf, tf, seed = p
    assume(sigma > 0)
    g = _grad(*shape, seed=seed, zero_rows=min(zero_rows, shape[0]))
    peak = torch.linalg.vector_norm(g, dim=1).max().item()
    out, _ = ref.flood(g, "rows", [rho, max(sigma, 1e-3), cf * peak, tf * peak], KEY, 16 * seed)
    assert (out != 0).any(dim=1).all()


def test_rows_threshold_is_strict_and_clip_and_ties_are_exact():
    """Norms 2, 2 (tied maxima), 0.5 = thr exactly (dropped: S is n > thr), 0.5 + 2^-20 (kept),
    0.25 (dropped), 0 (dropped); clip 1 halves the two largest. Every number here is exact in fp32."""
    g = torch.zeros(6, 8)
    g[0, 0], g[1, 3], g[2, 5], g[3, 1] = 2.0, -2.0, 0.5, 0.5 + 2**-20
    g[4, :4] = 0.125
    z = _z((6, 8), 1)
    out, stats = ref.flood(g, "rows", [0.5, 1.5, 1.0, 0.5], z=z)
    assert stats.tolist() == [1.5, 3.0, 2.0, 2.0]
    keep = torch.tensor([0.25, 0.25, 0.0, 0.5, 0.0, 0.0])  # rho min(1, clip / n_v) on S
    assert torch.equal(out, ref.fma(1.5, z, keep[:, None] * g))
    # the same with clip inactive: scale rho on S
    out, stats = ref.flood(g, "rows", [0.5, 1.5, math.inf, 0.5], z=z)
    assert stats.tolist() == [1.5, 3.0, 0.0, 2.0]
    assert torch.equal(out, ref.fma(1.5, z, torch.tensor([0.5, 0.5, 0, 0.5, 0, 0])[:, None] * g))


def test_tied_head_small_dense_rows_are_pure_noise():
    """Rows below thr (a tied head's dense softmax rows) carry no signal."""
    g = torch.full((8, 4), 1e-4)
    g[2] = 1.0
    z = _z((8, 4), 3)
    out, stats = ref.flood(g, "rows", [0.3, 1.0, math.inf, 0.01 * 2.0], z=z)
    assert stats[1].item() == 1
    rest = torch.arange(8) != 2
    assert torch.equal(out[rest], (1.0 * z)[rest])
    assert torch.equal(out[2], 0.3 * g[2] + z[2])


@pytest.mark.parametrize("clip,expect_scale", [(math.inf, 0.3), (100.0, 0.3), (2.5, 0.3 * 2.5 / 5.0)])
def test_matrix_stats_layout(clip, expect_scale):
    g = torch.zeros(4, 4)
    g[0, 0], g[3, 2] = 3.0, -4.0  # ||G||_F = 5 exactly
    out, stats = ref.flood(g, "matrix", [0.3, 2.0, clip, 0.0], z=torch.zeros(4, 4))
    assert stats.tolist() == pytest.approx([2.0, 5.0, expect_scale], rel=1e-7)
    assert stats[1].item() == 5.0
    assert torch.equal(out, stats[2] * g)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_zero_gradient(mode):
    z = _z((6, 4), 2)
    out, stats = ref.flood(torch.zeros(6, 4), mode, [0.25, 1.25, 1.0, 0.0], z=z)
    assert torch.equal(out, 1.25 * z)
    assert stats.tolist() == ([1.25, 0.0, 0.0, 0.0] if mode == "rows" else [1.25, 0.0, 0.25])
    out, _ = ref.flood(torch.zeros(6, 4), mode, [0.3, 0.0, 1.0, 0.0], KEY, 0)
    assert torch.equal(out, torch.zeros(6, 4))  # sigma 0: nothing added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rho", [0.3, 0.0])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_poisons_everything(bad, mode, rho, dtype):
    g = _grad(6, 4, seed=2).to(dtype)
    g[3, 1] = bad
    out, stats = ref.flood(g, mode, [rho, 1.0, 1.0, 0.01], KEY, 0)
    assert out.dtype == dtype and out.isnan().all() and stats.isnan().all()


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)])
def test_empty(mode, shape):
    out, stats = ref.flood(torch.zeros(shape), mode, [0.25, 1.5, 1.0, 0.0], KEY, 0)
    assert out.shape == shape
    assert stats.tolist() == ([1.5, 0.0, 0.0, 0.0] if mode == "rows" else [1.5, 0.0, 0.25])


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_non_contiguous_matches_contiguous(mode):
    base = _grad(12, 9, seed=4)
    for g in (base.t(), base[1::2, 2:]):
        assert not g.is_contiguous()
        out, stats = ref.flood(g, mode, [0.3, 1.0, 2.0, 0.5], KEY, 16)
        out2, stats2 = ref.flood(g.contiguous(), mode, [0.3, 1.0, 2.0, 0.5], KEY, 16)
        assert torch.equal(out, out2) and torch.equal(stats, stats2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_dtype_is_kept_and_the_arithmetic_is_fp32(dtype, mode):
    """Output in the gradient's dtype = the fp32 flood of the gradient's values, rounded once; the
    noise is the stream for that dtype (one word per 16-bit element, two otherwise)."""
    g = _grad(9, 7, seed=6).to(dtype)
    params = [0.3, 1.0, 3.0, 0.5]
    out, stats = ref.flood(g, mode, params, KEY, 32)
    za, zb = ref.noise_components(63, KEY, 32, ref.words_per_element(dtype), g.device)
    expect, expect_stats = ref.flood(g.float(), mode, params, z=za.view(9, 7), zb=None if zb is None else zb.view(9, 7))
    assert out.dtype == dtype and stats.dtype == torch.float32
    assert torch.equal(out, expect.to(dtype)) and torch.equal(stats, expect_stats)


def test_key_and_explicit_noise_agree():
    g = _grad(10, 6, seed=7)
    for mode in ("rows", "matrix"):
        a = ref.flood(g, mode, [0.3, 1.0, 2.0, 0.5], KEY, 48)
        za, zb = ref.noise_components(60, KEY, 48, 2, g.device)  # fp32: the two summands
        b = ref.flood(g, mode, [0.3, 1.0, 2.0, 0.5], z=za.view(10, 6), zb=zb.view(10, 6))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        c = ref.flood(g, mode, [0.3, 1.0, 2.0, 0.5], z=ref.noise((10, 6), KEY, 48))  # Z added in one FMA
        assert (a[0] - c[0]).abs().max() <= 4 * torch.finfo(torch.float32).eps * c[0].abs().max()


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: ref.flood(torch.ones(3, 3), "cols", [0.3, 1, 1, 0], KEY), ValueError, "mode"),
        (lambda: ref.flood(torch.ones(3, 3), "rows", [0.3, 1, 1], KEY), ValueError, "params must hold 4"),
        (lambda: ref.flood(torch.ones(3), "rows", [0.3, 1, 1, 0], KEY), ValueError, "mode='matrix'"),
        (lambda: ref.flood(torch.ones(2, 3, 4), "rows", [0.3, 1, 1, 0], KEY), ValueError, "2-D"),
        (lambda: ref.flood(torch.ones(3, 3).to_sparse(), "rows", [0.3, 1, 1, 0], KEY), ValueError, "sparse=False"),
        (lambda: ref.flood(torch.ones(3, 3).to_sparse(), "matrix", [0.3, 1, 1, 0], KEY), ValueError, "dense"),
        (lambda: ref.flood(torch.ones(3, 3, dtype=torch.int64), "rows", [0.3, 1, 1, 0], KEY), TypeError,
         "floating-point"),
        (lambda: ref.flood(torch.ones(3, 3), "rows", [0.3, 1, 1, 0], z=torch.ones(3, 4)), ValueError, "z has shape"),
        (lambda: ref.flood(torch.ones(3, 3), "rows", [0.3, 1, 1, 0]), ValueError, "pass either z"),
        (lambda: ref.flood(torch.ones(3, 3), "rows", [0.3, 1, 1, 0], KEY, 8), ValueError, "stream_offsets"),
        (lambda: ref.flood(torch.ones(3, 3), "rows", [0.3, 1, 1, 0], torch.zeros(8)), ValueError, "new_key"),
    ],
)
def test_bad_inputs_are_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------------- many tensors
def _mixed():
    gen = torch.Generator().manual_seed(21)
    grads = [torch.randn(9, 5, generator=gen), torch.randn(13, generator=gen),
             torch.randn(6, 4, generator=gen).t(), torch.randn(7, 3, generator=gen).to(torch.bfloat16),
             torch.zeros(0, 4), torch.randn(4, 6, generator=gen).to(torch.float16)]
    modes = ["rows", "matrix", "matrix", "rows", "rows", "matrix"]
    params = torch.tensor([[0.3, 1.0, 2.0, 0.1], [0.0, 4.0, math.inf, 0.0], [0.3, 1.0, 1.0, 0.0],
                           [0.5, 0.5, 1.0, 0.5], [0.3, 1.0, 1.0, 0.0], [1.0, 0.25, 0.5, 0.0]])
    return grads, modes, params


def test_flood_many_equals_single_floods_at_stream_offsets():
    grads, modes, params = _mixed()
    clean = [g.clone() for g in grads]
    ref.flood_many_(grads, modes, params, KEY)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    assert offsets == [0, 96, 128, 176, 208, 208]
    for g, c, mode, p, off in zip(grads, clean, modes, params, offsets):
        assert g.dtype == c.dtype
        assert torch.equal(g, ref.flood(c, mode, p, KEY, off)[0])


def test_flood_many_checks_its_table():
    grads, modes, params = _mixed()
    with pytest.raises(ValueError, match="same length"):
        ref.flood_many_(grads, modes[:-1], params, KEY)
    with pytest.raises(ValueError, match=r"\(6, 4\)"):
        ref.flood_many_(grads, modes, params[:5], KEY)
    with pytest.raises(ValueError, match="float32"):
        ref.flood_many_(grads, modes, params.double(), KEY)
    assert ref.split_modes("") == [] and ref.split_modes("rows, matrix,rows") == ["rows", "matrix", "rows"]


# ----------------------------------------------------------------------------- second moments
K_DRAWS = 400


def _draws(g, mode, params, dtype=torch.float32):
    """K_DRAWS floods of g under one key at disjoint offsets (independent noise)."""
    zs = ref.noise((K_DRAWS, *g.shape), KEY, 0, dtype)
    return torch.stack([ref.flood(g, mode, params, z=z)[0] for z in zs]).double()


@pytest.mark.parametrize("rho,sigma,cf", [(0.3, 1.0, math.inf), (0.0, 3.0, math.inf), (1.0, 0.5, 0.5)])
def test_rows_second_moment(rho, sigma, cf):
    """E||out_v||^2 = rho^2 s_v^2 ||g_v||^2 [v in S] + d sigma^2 per row;
    Var ||a + s z||^2 = 4 s^2 ||a||^2 + 2 d s^4."""
    g = _grad(12, 16, seed=3, zero_rows=4)
    d = g.shape[1]
    n64 = torch.linalg.vector_norm(g.double(), dim=1)
    clip, thr = cf * n64.max().item(), 0.01 * n64.max().item()
    outs = _draws(g, "rows", [rho, sigma, clip, thr])
    scale = rho * torch.where(n64 > clip, clip / n64, 1.0) * (n64 > thr)
    signal = (scale * n64) ** 2
    expected = signal + d * sigma**2
    var = 4 * sigma**2 * signal + 2 * d * sigma**4
    estimate = outs.pow(2).sum(-1).mean(0)
    assert ((estimate - expected).abs() <= 6 * (var / K_DRAWS).sqrt()).all()


@pytest.mark.parametrize("rho,sigma,clip", [(0.3, 1.0, math.inf), (0.0, 8.0, math.inf), (0.8, 0.5, 2.0)])
def test_matrix_second_moment(rho, sigma, clip):
    g = _grad(9, 11, seed=5)
    n = g.numel()
    outs = _draws(g, "matrix", [rho, sigma, clip, 0.0], torch.bfloat16)  # the 16-bit stream's normals too
    norm = torch.linalg.vector_norm(g.double()).item()
    signal = (rho * min(1.0, clip / norm) * norm) ** 2
    expected = signal + n * sigma**2
    var = 4 * sigma**2 * signal + 2 * n * sigma**4
    estimate = outs.pow(2).sum((1, 2)).mean().item()
    assert abs(estimate - expected) <= 6 * math.sqrt(var / K_DRAWS)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_bias_decomposition(mode):
    """E[out] = rho s G (on S for rows), so E[out] - G = (rho s - 1) G: the mean of K draws within 6 sigma/sqrt K."""
    rho, sigma = 0.3, 1.0
    g = _grad(10, 12, seed=9, zero_rows=2)
    n64 = torch.linalg.vector_norm(g.double(), dim=1)
    params = [rho, sigma, math.inf, 0.01 * n64.max().item()]
    outs = _draws(g, mode, params)
    kept = (n64 > params[3]).double()[:, None] if mode == "rows" else 1.0
    bias = outs.mean(0) - g.double()
    assert ((bias - (rho * kept - 1) * g.double()).abs() <= 6 * sigma / math.sqrt(K_DRAWS)).all()


# ----------------------------------------------------------------------------- calibration
@SETTINGS
@given(shapes, st.sampled_from([0.0, 0.01, 0.5]), st.integers(0, 10_000), st.integers(0, 5))
def test_statistic_and_batch_params(shape, tau, seed, zero_rows):
    """statistic: rows [mean of n_v over n_v > tau M, M]; matrix [mean |G|, ||G||_F].
    batch_params: [rho, lam m_bar, inf, tau M (rows) or 0]. Relative inflation bound of the paper:
    rho^2 ||g_v||^2 / (d sigma^2) <= rho^2 C^2 / (d lam^2) with C = M / m_bar."""
    g = _grad(*shape, seed=seed, zero_rows=min(zero_rows, shape[0]))
    n64 = torch.linalg.vector_norm(g.double(), dim=1)
    peak = n64.max().item()
    assume(_not_near(n64, tau * peak) or tau == 0)
    m_bar, m = ref.statistic(g, "rows", tau).tolist()
    active = n64 > tau * peak
    truth = n64[active].mean().item() if active.any() else 0.0
    assert abs(m - peak) <= (shape[1] + 2) * U32 * peak
    assert abs(m_bar - truth) <= (shape[1] + shape[0] + 4) * U32 * truth
    rho, lam = 0.3, 2.0
    p = ref.batch_params(g, "rows", rho, lam, tau)
    assert p.dtype == torch.float32 and p.shape == (4,)
    assert p[0].item() == pytest.approx(rho, rel=1e-7) and p[1].item() == pytest.approx(lam * m_bar, rel=1e-6)
    assert math.isinf(p[2].item()) and p[3].item() == pytest.approx(tau * m, rel=1e-6)
    if m_bar > 0:
        c = m / m_bar
        ratio = rho**2 * n64**2 / (shape[1] * p[1].item() ** 2)
        assert (ratio <= rho**2 * c**2 / (shape[1] * lam**2) * (1 + 1e-5)).all()
    mm_bar, mm = ref.statistic(g, "matrix", tau).tolist()
    assert mm_bar == pytest.approx(g.double().abs().mean().item(), rel=1e-5)
    assert mm == pytest.approx(torch.linalg.vector_norm(g.double()).item(), rel=1e-5)
    pm = ref.batch_params(g, "matrix", rho, lam, tau)
    assert pm[3].item() == 0.0 and math.isinf(pm[2].item()) and pm[1].item() == pytest.approx(lam * mm_bar, rel=1e-6)


def test_public_params():
    stat = torch.tensor([0.5, 4.0])  # [m_bar, M] of a public batch
    assert ref.public_params(stat, "rows", 0.3, 2.0, 0.01, 1.5).tolist() == pytest.approx([0.3, 1.0, 6.0, 0.04])
    assert ref.public_params(stat, "matrix", 0.3, 2.0, 0.01, 1.5).tolist() == pytest.approx([0.3, 1.0, 6.0, 0.0])
    # the public parameters flood any private gradient: nothing above read it
    out, stats = ref.flood(_grad(5, 4, seed=1), "rows", ref.public_params(stat, "rows", 0.3, 2.0, 0.01, 1.5), KEY)
    assert stats[0].item() == 1.0


def test_statistic_of_empty_and_zero_gradients():
    assert ref.statistic(torch.zeros(0, 4), "rows", 0.01).tolist() == [0.0, 0.0]
    assert ref.statistic(torch.zeros(3, 4), "rows", 0.01).tolist() == [0.0, 0.0]
    assert ref.statistic(torch.zeros(0), "matrix", 0.01).tolist() == [0.0, 0.0]
    out, _ = ref.flood(torch.zeros(3, 4), "rows", ref.batch_params(torch.zeros(3, 4), "rows", 0.3, 2.0, 0.01), KEY)
    assert torch.equal(out, torch.zeros(3, 4))  # batch calibration of a zero gradient: sigma 0
