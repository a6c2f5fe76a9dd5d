"""A CPU emulator of PyTorch's CUDA float path of ``torch.randn`` (rand.md 5, 8), for checking the element
mapping and the generator's offset independently of torch's kernel. Philox words and ``u`` are exact; ``log``,
``sqrt``, ``sin`` and ``cos`` are float64, so results agree with the device within rand.md 8's tolerance, never
bit for bit: it is not an oracle for exact bits."""
import numpy as np
import torch

from tilefuse.reference.moe import philox4x32_10

TWO_PI_F32 = float(np.float32(2 * np.pi))  # fp32(2 pi) = 0x40C90FDB
MASK = 0xFFFFFFFF


def _words(index_words, seed: int):
    """The four Philox words of counters ``index_words`` (four uint32 numpy arrays) under key ``seed``, through
    the MoE reference's Philox4x32-10 (cuRAND's block function, checked there against the known answers)."""
    counter = [torch.from_numpy(w.astype(np.int64)) for w in index_words]
    key = [torch.tensor(seed & MASK), torch.tensor(seed >> 32)]
    return [w.numpy().astype(np.uint64) for w in philox4x32_10(counter, key)]


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
    w = _words((block & MASK, block >> 32, tau & MASK, tau >> 32), seed)
    first = np.where(lane < 2, w[0], w[2])
    second = np.where(lane < 2, w[1], w[3])
    sin, cos = _box_muller(first, second)
    return np.where(lane % 2 == 0, sin, cos)


def offset_advance(n: int, threads_max: int, per_step: int = 4) -> int:
    """rand.md 5.7: A(n) = 4 ceil(n / (L S)), S the threads of the launch (S_max for large n)."""
    threads = min(threads_max, -(-n // 256) * 256)
    return 4 * -(-n // (per_step * threads))
