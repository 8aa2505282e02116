"""Key agreement, share encryption and mask expansion."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedtrain.errors import SecAggError
from fedtrain.secagg import crypto


def test_key_agreement_is_symmetric_and_keys_are_separated() -> None:
    a, b = crypto.KeyPair.generate(), crypto.KeyPair.generate()
    secret = a.exchange(b.public)
    assert secret == b.exchange(a.public) and len(secret) == 32
    assert crypto.share_key(secret, 3, 1, 2) == crypto.share_key(secret, 3, 2, 1)
    assert crypto.pair_mask_seed(secret, 3, 1, 2) == crypto.pair_mask_seed(secret, 3, 2, 1)
    keys = {
        crypto.share_key(secret, 3, 1, 2),
        crypto.pair_mask_seed(secret, 3, 1, 2),
        crypto.pair_mask_seed(secret, 4, 1, 2),
        crypto.pair_mask_seed(secret, 3, 1, 5),
    }
    assert len(keys) == 4
    rebuilt = crypto.KeyPair.from_private_bytes(a.private_bytes())
    assert rebuilt.public == a.public


def test_low_order_public_key_is_refused() -> None:
    with pytest.raises(SecAggError, match="key agreement failed"):
        crypto.KeyPair.generate().exchange(bytes(32))


def test_share_encryption_detects_every_bit_flip() -> None:
    key = os.urandom(32)
    ct = crypto.encrypt_shares(key, b"secret shares", 7, 1, 2)
    assert crypto.decrypt_shares(key, ct, 7, 1, 2) == b"secret shares"
    for bit in range(0, len(ct) * 8, 13):
        bad = bytearray(ct)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(SecAggError, match="failed authentication"):
            crypto.decrypt_shares(key, bytes(bad), 7, 1, 2)


@pytest.mark.parametrize("ad", [(8, 1, 2), (7, 2, 1), (7, 1, 3)])
def test_share_encryption_is_bound_to_round_sender_receiver(ad: tuple[int, int, int]) -> None:
    key = os.urandom(32)
    ct = crypto.encrypt_shares(key, b"x", 7, 1, 2)
    with pytest.raises(SecAggError):
        crypto.decrypt_shares(key, ct, *ad)


def test_mask_is_the_aes_128_ctr_keystream_of_an_hkdf_key_added_mod_2_32() -> None:
    seed = os.urandom(32)
    n = 1001
    key = HKDF(hashes.SHA256(), 16, None, b"fedtrain/secagg/v1/mask-prg").derive(seed)
    assert crypto.mask_key(seed) == key
    counter = bytes(12) + (2).to_bytes(4, "big")  # GCM's first data block
    enc = Cipher(algorithms.AES128(key), modes.CTR(counter)).encryptor()
    reference = np.frombuffer(enc.update(bytes(4 * n)), dtype="<u4").astype(np.uint32)
    target = np.full(n, 0xFFFFFFF0, dtype=np.uint32)
    crypto.MaskExpander(chunk_elements=64).apply(target, seed, 1)
    assert np.array_equal(target, np.uint32(0xFFFFFFF0) + reference)  # wraps


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 16])
@pytest.mark.parametrize("offset", [0, 1, 3, 4, 130])
def test_masks_of_chunks_at_offsets_match_the_whole(chunk: int, offset: int) -> None:
    seed = os.urandom(32)
    whole = np.zeros(400, dtype=np.uint32)
    crypto.MaskExpander().apply(whole, seed, 1)
    part = np.zeros(200, dtype=np.uint32)
    crypto.MaskExpander(chunk_elements=chunk).apply(part, seed, 1, offset=offset)
    assert np.array_equal(part, whole[offset : offset + 200])


@pytest.mark.parametrize("chunk", [5, 64, 1 << 15])
def test_many_masks_in_one_pass_equal_them_one_by_one(chunk: int) -> None:
    target = np.random.default_rng(1).integers(0, 2**32, size=1000, dtype=np.uint32)
    masks = [(crypto.new_seed(), sign) for sign in (1, -1, 1, 1, -1)]
    one_by_one = target.copy()
    for seed, sign in masks:
        crypto.MaskExpander().apply(one_by_one, seed, sign)
    crypto.MaskExpander(chunk_elements=chunk).apply_many(target[3:], masks, offset=3)
    crypto.MaskExpander(chunk_elements=chunk).apply_many(target[:3], masks)
    assert np.array_equal(target, one_by_one)
    with pytest.raises(SecAggError, match="sign must be"):
        crypto.MaskExpander().apply_many(target, [(crypto.new_seed(), 2)])


def test_add_then_subtract_restores_and_input_checks() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=5000, dtype=np.uint32)
    y = x.copy()
    expander = crypto.MaskExpander(chunk_elements=1000)
    seed = crypto.new_seed()
    expander.apply(y, seed, 1)
    assert not np.array_equal(x, y)
    expander.apply(y, seed, -1)
    assert np.array_equal(x, y)
    with pytest.raises(SecAggError, match="32 bytes"):
        expander.apply(y, seed[:16], 1)
    with pytest.raises(SecAggError, match="outside"):
        expander.apply(y, seed, 1, offset=crypto.MAX_MASK_ELEMENTS - 10)
    with pytest.raises(SecAggError, match="uint32"):
        expander.apply(y.astype(np.int64), seed, 1)
