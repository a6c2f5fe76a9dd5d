"""A CPU emulator of PyTorch's CUDA float path of ``torch.randn`` (rand.md 5, 8), for checking the element
mapping and the generator's offset independently of torch's kernel. Philox words and ``u`` are exact; ``log``,
``sqrt``, ``sin`` and ``cos`` are float64, so results agree with the device within rand.md 8's tolerance, never
bit for bit: it is not an oracle for exact bits."""
import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
BUMP0, BUMP1 = 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF
TWO_PI_F32 = float(np.float32(2 * np.pi))  # fp32(2 pi) = 0x40C90FDB


def philox4x32_10(counter, key):
    """Philox4x32-10 of uint64 arrays: ``counter`` 4 words (least significant first), ``key`` 2 words; returns 4."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & MASK for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & MASK for k in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + BUMP0) & MASK, (k1 + BUMP1) & MASK
        p0, p1 = M0 * c0, M1 * c2  # < 2**64: exact in uint64
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def _box_muller(wa, wb):
    """(s sin v, s cos v) in float64 from two word arrays (rand.md 5.5)."""
    u = (wa.astype(np.float32).astype(np.float64) * 2.0 ** -32 + 2.0 ** -33).astype(np.float32)
    k = TWO_PI_F32 * 2.0 ** -32
    v = (wb.astype(np.float32).astype(np.float64) * k + k / 2).astype(np.float32).astype(np.float64)
    s = np.sqrt(-2 * np.log(u.astype(np.float64)))
    return s * np.sin(v), s * np.cos(v)


def randn_f32(index, seed: int, offset: int, threads: int):
    """Element ``index`` (an int array) of an fp32 ``torch.randn`` drawn at generator ``(seed, offset)`` with
    ``threads`` = 256 x grid threads (rand.md 5.3: S_max when n > S_max, else any S >= n gives tau = i)."""
    index = np.asarray(index, dtype=np.uint64)
    tau, rest = index % threads, index // threads
    step, lane = rest // 4, rest % 4
    block = np.uint64(offset // 4) + step
    w = philox4x32_10((block & MASK, block >> 32, tau & MASK, tau >> 32), (seed & MASK, seed >> 32))
    first = np.where(lane < 2, w[0], w[2])
    second = np.where(lane < 2, w[1], w[3])
    sin, cos = _box_muller(first, second)
    return np.where(lane % 2 == 0, sin, cos)


def offset_advance(n: int, threads_max: int, per_step: int = 4) -> int:
    """rand.md 5.7: A(n) = 4 ceil(n / (L S)), S the threads of the launch (S_max for large n)."""
    threads = min(threads_max, -(-n // 256) * 256)
    return 4 * -(-n // (per_step * threads))
