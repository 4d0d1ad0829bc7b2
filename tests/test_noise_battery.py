"""The attacker's battery against the noise stream (aegis.attacks.noise_structure).

Setting: a rows flood at huge lam (sigma = 1000 x the mean signal-row norm, so row norms carry
nothing), rho 0.3, no clip, thr 0: S = the signal rows. The server sees the exported tensor and sigma
and asks which rows carried signal. Every feature family (angle / radius lattices, mantissa bits,
collisions, tails, fp32 rounding images) and all of them together must score a held-out AUC <= 0.55.

Sampling noise: the AUC is the mean over two folds (train on one half of the rows, score the other,
swap), so under "no structure" each fold's AUC is a Mann-Whitney AUC on V / 2 rows: sd = sqrt((n1 +
n0 + 1) / (12 n1 n0)) with n1 = A / 2 signal and n0 = (V - A) / 2 noise rows. The two folds' AUCs are
strongly correlated under the null (0.65 measured), so the mean keeps about that sd (ns.auc_null_sd).
Reference case V = 4000 rows of d = 128, A = 1000 signal rows: sd = 0.0149, so 0.55 is 3.4 sd above
0.5 (fixed seeds); the numba CPU flood (torch.ops.aegis on CPU) gets its own case of that size.
Interpreter case (V = 2048, d = 64, A = 512, sd = 0.0208): bound 0.5 + 4 sd = 0.583.
GPU case (V = 6000, A = 1500, sd = 0.0122): 0.55 (4.1 sd).

The "image" family asks whether a row's fp32 values all lie in the rounding image of a product by
the public sigma (fl(c z)): a flood that rounded sigma * Z on its own would leave pure-noise rows
there and signal rows outside (AUC 1.0); the flood adds each summand in a fused multiply-add
instead (docs/design.md §1.2), and the family must score at the null level like the others.

Regression: the same battery breaks the OLD stream (tests/old_stream.py: Philox, 12-bit angles):
old_lattice_statistic alone separates the rows with AUC 1.0, the angle and radius families too.
Sanity: each family, handed a deliberately weakened stream, reaches AUC >= 0.9.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import old_stream
from aegis.attacks import noise_structure as ns
from aegis_kernels import reference as ref

RHO = 0.3
LAM = 1000.0  # sigma = LAM x mean signal-row norm: the norms carry nothing
BOUND = 0.55
FOLDS = 2
V, D, ACTIVE = 4000, 128, 1000  # reference case
IV, ID, IACTIVE = 2048, 64, 512  # interpreter case
GV, GACTIVE = 6000, 1500  # GPU case
KEY = 0xAE615EEDBA77E27  # tests only: a fixed key (conftest sets AEGIS_ALLOW_FIXED_KEY)
OLD_SEED = 0x2545F4914F6CDD1D & (2**62 - 1)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _null_sd(v: int, a: int) -> float:
    return ns.auc_null_sd(a, v - a, FOLDS)


def _case(v: int, d: int, a: int, dtype: torch.dtype, seed: int = 0, device="cpu"):
    """(grad, labels, sigma): ``a`` random signal rows (random directions, norms spread over e^{+-1}),
    the rest zero; sigma = LAM x their mean norm (an fp32 value, as the flood's params hold it)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.zeros(v, dtype=torch.bool)
    labels[torch.randperm(v, generator=gen)[:a]] = True
    g = torch.zeros(v, d)
    sig = torch.randn(a, d, generator=gen)
    sig = sig / sig.norm(dim=1, keepdim=True) * torch.exp(torch.randn(a, 1, generator=gen) * 0.5)
    g[labels] = sig
    g = g.to(dtype)
    sigma = torch.tensor(LAM * g.float().norm(dim=1)[labels].mean().item(), dtype=torch.float32)
    return g.to(device), labels, float(sigma)


def _params(sigma: float) -> torch.Tensor:
    return torch.tensor([RHO, sigma, math.inf, 0.0], dtype=torch.float32)


def _check(aucs: dict[str, float], bound: float) -> None:
    bad = {k: round(v, 3) for k, v in aucs.items() if v > bound}
    assert not bad, f"distinguishable (AUC > {bound:.3f}): {bad}; all: { {k: round(v, 3) for k, v in aucs.items()} }"


def _run_battery(out: torch.Tensor, sigma: float, labels: torch.Tensor) -> dict:
    """Held-out AUC per feature family and for all together."""
    return ns.distinguish(ns.extract(out, sigma), labels, folds=FOLDS)


# ----------------------------------------------------------------------------- helpers' own checks
def test_auc_and_classifier():
    """Mann-Whitney AUC with ties against the pair count; the classifier finds a planted feature."""
    gen = torch.Generator().manual_seed(3)
    s = torch.randint(0, 5, (200,), generator=gen).double()
    y = torch.rand(200, generator=gen) < 0.3
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean().item()
    assert ns.auc(s, y) == pytest.approx(brute, abs=1e-12)
    X = torch.randn(400, 8, generator=gen)
    y = torch.rand(400, generator=gen) < 0.25
    X[:, 7] += 4.0 * y  # AUC Phi(4 / sqrt 2) = 0.998
    res = ns.distinguish({"noise": X[:, :7], "planted": X[:, 7:]}, y)
    assert res["planted"] > 0.95 and res["all"] > 0.95 and res["noise"] < 0.65
    assert 3 * _null_sd(V, ACTIVE) < BOUND - 0.5  # sd 0.0149: the 0.05 margin is 3.4 sd


def test_old_stream_is_philox_kat():
    """The old-stream copy's Philox4x32-10 against Random123's known-answer vectors."""
    z = torch.zeros(1, dtype=torch.int64)
    assert [int(w) for w in old_stream.philox4x32(0, z, z, z, z)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    t = lambda v: torch.tensor([v])  # noqa: E731
    got = old_stream.philox4x32(0x299F31D0A4093822, t(0x243F6A88), t(0x85A308D3), t(0x13198A2E), t(0x03707344))
    assert [int(w) for w in got] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


# ----------------------------------------------------------------------------- new stream (reference, CPU)
@functools.cache
def _reference_results(name: str):
    dtype = DTYPES[name]
    g, labels, sigma = _case(V, D, ACTIVE, dtype, seed=1)
    out, stats = ref.flood(g, "rows", _params(sigma), key=ref.key_from_int(KEY), offset=0)
    assert out.dtype == dtype and int(stats[1]) == ACTIVE
    sigma_pub = stats[0].item()  # what the server reads
    full = clean = _run_battery(out, sigma_pub, labels)
    old_stat = ns.auc(ns.old_lattice_statistic(out).double(), ~labels)
    print(f"\nnew stream, reference, {name}: {({k: round(v, 3) for k, v in full.items()})}, old lattice {old_stat:.3f}")
    return full, clean, old_stat


@pytest.mark.parametrize("name", list(DTYPES))
def test_new_stream_reference(name):
    """Rows flood through the reference on CPU: no family (nor all together) tells signal rows from
    pure-noise rows, for every output dtype."""
    full, clean, old_stat = _reference_results(name)
    _check(clean, BOUND)
    assert old_stat <= BOUND


# ----------------------------------------------------------------------------- new stream (numba CPU flood)
@functools.cache
def _cpu_results(name: str):
    """The registered CPU op (aegis_kernels.cpu, numba), on its own case and key; the reference's noise
    is refused while it runs, so the battery reads the numba path's output."""
    pytest.importorskip("numba")
    import aegis_kernels  # noqa: F401  (registers the CPU flood)

    dtype = DTYPES[name]
    g, labels, sigma = _case(V, D, ACTIVE, dtype, seed=4)
    mp = pytest.MonkeyPatch()
    mp.setattr(ref, "noise_components", None)  # a call would raise
    try:
        out, stats = torch.ops.aegis.flood(g, "rows", _params(sigma), ref.key_from_int(KEY + 4), 0)
    finally:
        mp.undo()
    assert out.dtype == dtype and int(stats[1]) == ACTIVE
    full = _run_battery(out, stats[0].item(), labels)
    old_stat = ns.auc(ns.old_lattice_statistic(out).double(), ~labels)
    print(f"\nnew stream, CPU flood, {name}: {({k: round(v, 3) for k, v in full.items()})}, old lattice {old_stat:.3f}")
    return full, old_stat


@pytest.mark.parametrize("name", list(DTYPES))
def test_new_stream_cpu_flood(name):
    """torch.ops.aegis.flood on CPU (the numba flood that mask_() runs): the same bound as the reference."""
    full, old_stat = _cpu_results(name)
    _check(full, BOUND)
    assert old_stat <= BOUND


# ----------------------------------------------------------------------------- old stream: must break
@functools.cache
def _old_results():
    g, labels, _ = _case(V, D, ACTIVE, torch.float32, seed=1)
    out, stats = old_stream.flood(g, "rows", RHO, LAM, 0.01, seed=OLD_SEED)
    assert int(stats[2]) == ACTIVE
    stat = ns.old_lattice_statistic(out)
    full = ns.distinguish(ns.extract(out, stats[1].item()), labels, folds=FOLDS)
    scores = {k: round(v, 3) for k, v in full.items()}
    print(f"\nold stream, fp32: {scores}, old lattice {ns.auc(stat.double(), ~labels):.3f}")
    return out, labels, stat, full


def test_old_stream_breaks():
    """Regression: the battery breaks the old Philox stream (fp32 outputs, as the old flood gave them)."""
    out, labels, stat, full = _old_results()
    pairs = D // 2
    assert ns.auc(stat.double(), ~labels) >= 0.95  # noise rows: their pairs sit on the 2^12 lattice
    assert stat[~labels].double().mean() > 0.99 * pairs and stat[labels].double().mean() < 0.2 * pairs
    assert full["angle"] >= 0.95 and full["radius"] >= 0.95 and full["all"] >= 0.95
    with pytest.raises(AssertionError):
        _check(full, BOUND)


@pytest.mark.slow
def test_old_stream_breaks_fp16():
    """The old stream leaked in fp16 too: near the axes a coordinate keeps fine absolute precision, so
    the 12-bit angle lattice survives the rounding there (old statistic AUC 0.77, d = 256); bf16 hides
    it (0.56)."""
    g, labels, _ = _case(V, 256, ACTIVE, torch.float16, seed=1)
    out, stats = old_stream.flood(g, "rows", RHO, LAM, 0.01, seed=OLD_SEED)
    assert ns.auc(ns.old_lattice_statistic(out).double(), ~labels) >= 0.7
    full = ns.distinguish(ns.extract(out, stats[1].item(), ["angle"]), labels, folds=FOLDS)
    assert full["angle"] >= 0.6


# ----------------------------------------------------------------------------- the battery has teeth
def _weak_case(seed: int = 5):
    return _case(1200, 64, 300, torch.float32, seed=seed)


def _snap_pairs(z: torch.Tensor, angle_bits: int | None = None, radius_bits: int | None = None) -> torch.Tensor:
    """z with each lane pair (2k, 2k+1) moved onto a 2^angle_bits angle lattice or a 2^-radius_bits
    lattice of u = exp(-r^2 / 2) (cell midpoints, as the old stream drew it)."""
    a, b = z[:, 0::2].double(), z[:, 1::2].double()
    r, th = torch.sqrt(a * a + b * b), torch.atan2(b, a)
    if angle_bits is not None:
        step = 2 * math.pi / 2**angle_bits
        th = torch.round(th / step) * step
    if radius_bits is not None:
        u = (torch.floor(torch.exp(-r * r / 2) * 2**radius_bits) + 0.5) * 2.0**-radius_bits
        r = torch.sqrt(-2 * torch.log(u))
    out = torch.empty_like(z)
    out[:, 0::2], out[:, 1::2] = (r * torch.cos(th)).float(), (r * torch.sin(th)).float()
    return out


def _weak_stream(kind: str):
    """(exported tensor, sigma, labels) from a deliberately weakened stream."""
    g, labels, sigma = _weak_case()
    key = ref.key_from_int(KEY + 1)
    if kind in ("angle", "radius"):  # structure in the noise for all rows; the signal knocks it off
        z = ref.noise(tuple(g.shape), key, 0, torch.float32)
        z = _snap_pairs(z, angle_bits=12) if kind == "angle" else _snap_pairs(z, radius_bits=20)
        out, _ = ref.flood(g, "rows", _params(sigma), z=z)
        return out, sigma, labels
    if kind == "image":  # noise rows end in a rounded product, signal rows in a rounded sum
        z = torch.randn(g.shape, generator=torch.Generator().manual_seed(9))
        out = torch.where(labels[:, None], (RHO * g + sigma * z.double()).float(), torch.tensor(sigma) * z)
        return out, sigma, labels
    dtype = {"mantissa": torch.bfloat16, "collision": torch.float16, "tail": torch.float16}[kind]
    out, _ = ref.flood(g.to(dtype), "rows", _params(sigma), key=key, offset=0)
    noise = ~labels
    if kind == "mantissa":  # noise rows: the last stored bit cleared
        bits = out.view(torch.int16)
        out = torch.where(noise[:, None], bits & ~1, bits).view(dtype)
    elif kind == "collision":  # noise rows: four values repeated
        out = out.clone()
        out[noise, 1:8:2] = out[noise, 0:8:2]
    elif kind == "tail":  # noise rows: tails cut at 2 sigma
        out = torch.where(noise[:, None], out.clamp(-2 * sigma, 2 * sigma), out)
    return out, sigma, labels


@pytest.mark.parametrize("family", list(ns.FAMILIES))
def test_battery_has_teeth(family):
    """Each family, handed a stream weakened in what it measures, tells the rows apart (AUC >= 0.9)."""
    out, sigma, labels = _weak_stream(family)
    res = ns.distinguish(ns.extract(out, sigma, [family]), labels, folds=FOLDS)
    assert res[family] >= 0.9, res


# ----------------------------------------------------------------------------- kernels (Triton interpreter, CPU)
@functools.cache
def _interpreter_results(name: str):
    TF = pytest.importorskip("aegis_kernels.triton")
    dtype = DTYPES[name]
    g, labels, sigma = _case(IV, ID, IACTIVE, dtype, seed=2)
    out, stats = TF.flood(g, "rows", _params(sigma), ref.key_from_int(KEY + 2), 0)
    sigma_pub = stats[0].item()
    full = clean = _run_battery(out, sigma_pub, labels)
    print(f"\nnew stream, interpreter, {name}: {({k: round(v, 3) for k, v in full.items()})}")
    return full, clean


@pytest.mark.parametrize("name", list(DTYPES))
def test_new_stream_interpreter(name):
    """The Triton kernels (CPU interpreter) on 2048 x 64: bound 0.5 + 4 sd (sd = 0.0208)."""
    _, clean = _interpreter_results(name)
    _check(clean, 0.5 + 4 * _null_sd(IV, IACTIVE))


# ----------------------------------------------------------------------------- GPU (torch.ops.aegis on CUDA)
GPU_CASES = [("fp32", 768), ("fp16", 768), ("bf16", 4096)]


@functools.cache
def _gpu_results(name: str, d: int):
    import aegis_kernels  # noqa: F401  (registers the CUDA kernels)

    dtype = DTYPES[name]
    g, labels, sigma = _case(GV, d, GACTIVE, dtype, seed=3, device="cuda")
    key = ref.key_from_int(KEY + 3).cuda()
    out, stats = torch.ops.aegis.flood(g, "rows", _params(sigma).cuda(), key, 0)
    torch.cuda.synchronize()
    assert int(stats[1]) == GACTIVE
    full = clean = _run_battery(out, stats[0].item(), labels)
    old_stat = ns.auc(ns.old_lattice_statistic(out).double(), ~labels)
    print(
        f"\nnew stream, CUDA, {name} d={d}: { ({k: round(v, 3) for k, v in full.items()}) }, old lattice {old_stat:.3f}"
    )
    return full, clean, old_stat


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,d", GPU_CASES)
def test_new_stream_cuda(name, d):
    """The fused kernels on CUDA, 6000 rows (sd = 0.0122)."""
    _, clean, old_stat = _gpu_results(name, d)
    _check(clean, BOUND)
    assert old_stat <= BOUND
