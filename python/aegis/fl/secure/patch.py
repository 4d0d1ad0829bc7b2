"""SecAgg+ masks from a cipher keyed by the whole shared secret, patched into Flower.

Flower 1.42's ``pseudo_rand_gen`` (``flwr.common.secure_aggregation.secaggplus_utils``) folds every seed
(the 32-byte private-mask seed, the 44-byte ECDH pairwise key) to one 32-bit integer by XOR and seeds
NumPy's Mersenne Twister with it: a curious server can enumerate the 2^32 mask streams, and two seeds
with the same fold mask alike (upstream flwrlabs/flower#7522). :func:`cipher_masks` replaces it with
ChaCha20 (``cryptography``) under ``SHA-256(domain || seed)``, so every byte of the secret keys the
stream, and reads each mask word uniformly from ``[0, num_range)``.

Both sides must use the same generator: the client (``secaggplus_mod``) masks with it and the server
(``SecAggPlusWorkflow``) removes the masks of survivors and dropouts with it. :func:`install` rebinds
the name in both modules (and in the module that defines it) after checking that each still holds
Flower's original function with its known signature; anything else (a Flower release that moved or
changed it) raises instead of running with an unknown mask generator.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import math
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

_DEFINED_IN = "flwr.common.secure_aggregation.secaggplus_utils"
# The two users of the generator: the client mod (masks) and the server workflow (unmasks).
_USERS = (
    "flwr.client.mod.secure_aggregation.secaggplus_mod",
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow",
)
_NAME = "pseudo_rand_gen"
_SIGNATURE = ("seed", "num_range", "dimensions_list")
_DOMAIN = b"aegis-secagg+-mask-v1\x00"
_NONCE = bytes(16)  # one key per seed: the stream never repeats under a key, so a zero nonce is fine
_MAX_RANGE = 2**62  # Flower's masked arithmetic is int64

_original = None  # Flower's generator, recorded at the first install()


def cipher_masks(seed: bytes, num_range: int, dimensions_list: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Masks uniform in ``[0, num_range)`` (int64), one array per shape, from ChaCha20 keyed by
    ``SHA-256(domain || seed)``. Drop-in for Flower's ``pseudo_rand_gen`` (same arguments, same output
    types: a 0-d array for an empty shape)."""
    if not isinstance(seed, bytes) or not seed:
        raise ValueError(f"seed must be non-empty bytes (a SecAgg+ mask seed or shared key), got {type(seed).__name__}")
    if num_range < 2 or num_range > _MAX_RANGE or num_range & (num_range - 1):
        raise ValueError(
            f"num_range={num_range}: SecAgg+ masks need a power-of-two modulus in [2, 2^62] "
            "(set SecAggPlusWorkflow(modulus_range=2**k))"
        )
    sizes = [math.prod(d) for d in dimensions_list]
    key = hashlib.sha256(_DOMAIN + seed).digest()
    stream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor().update(bytes(8 * sum(sizes)))
    words = (np.frombuffer(stream, dtype="<u8") & np.uint64(num_range - 1)).astype(np.int64)
    out, start = [], 0
    for dims, n in zip(dimensions_list, sizes):
        out.append(words[start : start + n].reshape(tuple(dims)))
        start += n
    return out


def _modules():
    return [importlib.import_module(name) for name in (_DEFINED_IN, *_USERS)]


def install() -> None:
    """Make Flower's SecAgg+ client mod and server workflow mask with :func:`cipher_masks`.

    Idempotent. Raises ``RuntimeError`` if any of the three modules holds something other than
    Flower's original generator (recognised by identity and signature) or this one."""
    global _original
    modules = _modules()
    current = getattr(modules[0], _NAME, None)
    if _original is None:
        if current is cipher_masks:
            raise RuntimeError("aegis.fl.secure.patch: installed by another copy of this module; import it once")
        params = tuple(inspect.signature(current).parameters) if callable(current) else None
        if params != _SIGNATURE or getattr(current, "__module__", None) != _DEFINED_IN:
            raise RuntimeError(
                f"Flower's SecAgg+ mask generator changed ({_DEFINED_IN}.{_NAME} is {current!r} with parameters "
                f"{params}, expected {_SIGNATURE}): aegis.fl.secure cannot replace it safely; pin flwr==1.42.* "
                "or update aegis.fl.secure.patch for this Flower release"
            )
        _original = current
    for module in modules:
        bound = getattr(module, _NAME, None)
        if bound is not _original and bound is not cipher_masks:
            raise RuntimeError(
                f"{module.__name__}.{_NAME} is {bound!r}, neither Flower's original generator nor "
                "aegis.fl.secure.patch.cipher_masks: Flower's SecAgg+ internals changed; pin flwr==1.42.* or "
                "update aegis.fl.secure.patch"
            )
    for module in modules:
        setattr(module, _NAME, cipher_masks)


def installed() -> bool:
    """True when every module of Flower's SecAgg+ masks with :func:`cipher_masks`."""
    return all(getattr(m, _NAME, None) is cipher_masks for m in _modules())


def require_installed() -> None:
    """Fail closed: a secure round must not run with Flower's 32-bit-seeded generator."""
    if not installed():
        raise RuntimeError(
            "Flower's SecAgg+ still masks with its 32-bit-seeded generator: call aegis.fl.secure.patch.install() "
            "in the ClientApp and the ServerApp process before a secure round"
        )


def flower_generator():
    """Flower's original generator (for tests that show why it is replaced); installs the patch first."""
    install()
    return _original
