"""A model of csrc/cross_spectrum/cuda/cross_spectrum_s_stage_mma.cu's stores of Q: which thread writes which entry,
with what value, by which store instruction. The new mapping (a 16-byte store per pair of
adjacent entries of row i, 8-byte stores of the mirrored ones) against the one before it (an
8-byte store per entry and per mirror) and against a plain reference, Q[m] = sum_fw
coef[fw, m] S_f (cross_spectrum_rows_aten), for several channels per group (both BlockPlan
kinds: paired blocks at an even tile count, partial blocks at an odd one), two groups and the
lag launches of 5 and 2:

  * every entry of Q is written exactly once, by the thread and with the bits the old
    mapping wrote (its sums A, B, C, D are the same registers, combined the same way),
    and equal to the reference to float64 rounding;
  * every 16-byte store is 16-byte aligned (an even Cig);
  * the bytes per 32-byte sector of each store instruction, before and after: with Cig a
    multiple of 4 (rows of whole sectors), every sector a new store instruction touches is
    whole outside the diagonal tiles and the last, partial tile.

The kernel's sums are float32; the model keeps them in float64 (the mapping, not the
rounding, is what is checked).

    (run by tests/test_index_models.py)
"""
import numpy as np

from .w_stage_plan import blocks_per_row, kBlockRows, kTileCols, kWarps, locate  # the block plan

kMaxLags = 5


def warps_of(cig):
    """(p, q) of every active warp of a row, and whether its block is a pair."""
    T = (cig + kTileCols - 1) // kTileCols
    for y in range(blocks_per_row(T)):
        P, q0, rows_n = locate(y, T)
        paired = rows_n != kBlockRows
        for warp in range(kWarps):
            p = P[warp // 2 if paired else 0]
            q = q0 + (warp % 2 if paired else warp)
            if p >= 0 and q < T: yield y, warp, p, q, paired


class Stores:
    """Q's flat float2 array, who wrote each entry, and each store instruction's bytes."""

    def __init__(self, size):
        self.q = np.full(size, np.nan, complex)
        self.count = np.zeros(size, int)
        self.who = np.full(size, -1, np.int64)
        self.instructions = []  # (sectors touched, bytes written, whole-tile instruction)

    def store(self, flat, values, who, width, full_tile):
        """One store instruction: lane k writes `width` entries from flat[k] (none where flat < 0)."""
        sectors, nbytes = {}, 0
        for f, v, w in zip(flat, values, who):
            if f < 0: continue
            assert (f * 8) % (8 * width) == 0, ("misaligned", f, width)
            for d in range(width):
                self.q[f + d] = v[d]
                self.count[f + d] += 1
                self.who[f + d] = w
                sec = (f + d) * 8 // 32
                sectors[sec] = sectors.get(sec, 0) + 8
            nbytes += 8 * width
        if sectors: self.instructions.append((sectors, nbytes, full_tile))


def model(cig, groups, lags_total, rows=2, lwf=5, batch=3, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, lwf, batch, groups, cig)) +
         1j * rng.standard_normal((rows, lwf, batch, groups, cig))).astype(np.complex64).astype(complex)
    coef = rng.standard_normal((lwf, lags_total)) + 1j * rng.standard_normal((lwf, lags_total))
    coef[:, 0] = coef[:, 0].real  # lag 0 is real (kLag0Real)
    s = np.einsum("rfbgi,rfbgj->rfgij", x.conj(), x)  # S_f per row and group
    ref = np.einsum("fm,rfgij->rmgij", coef, s)  # [row, lag, group, i, j], as the ATen route
    entries = groups * cig * cig
    size = rows * lags_total * entries
    old, new = Stores(size), Stores(size)
    T = (cig + kTileCols - 1) // kTileCols
    lane = np.arange(32)
    g, t4 = lane // 4, lane % 4
    for row in range(rows):
        for group in range(groups):
            for lag0 in range(0, lags_total, kMaxLags):
                lags = min(kMaxLags, lags_total - lag0)
                base = (row * lags_total + lag0) * entries + group * cig * cig
                for y, warp, p, q, paired in warps_of(cig):
                    i0 = kBlockRows * p
                    # neither diagonal nor partial, and rows of whole sectors (Cig a multiple of 4)
                    full_tile = 8 * q + 8 <= cig and q > 2 * p + 1 and cig % 4 == 0
                    tid = lambda e: ((((row * groups + group) * 64 + y) * kWarps + warp) * 32 + lane) * 4 + e
                    # The thread's sums per entry e: acc = (A, C), mir = (B, D) of cross_spectrum_s_stage.cu.
                    acc, mir = {}, {}
                    for e in range(4):
                        i = i0 + g + (8 if e >= 2 else 0)
                        j = kTileCols * q + 2 * t4 + (e & 1)
                        sv = s[row, :, group][:, np.minimum(i, cig - 1), np.minimum(j, cig - 1)]  # [fw, lane]
                        w = coef[:, lag0:lag0 + lags]
                        acc[e] = [(w[:, m].real @ sv.real, w[:, m].real @ sv.imag) for m in range(lags)]
                        mir[e] = [(w[:, m].imag @ sv.imag, w[:, m].imag @ sv.real) for m in range(lags)]
                    direct = lambda e, m: [complex(acc[e][m][0][k] - mir[e][m][0][k], acc[e][m][1][k] + mir[e][m][1][k])
                                           for k in range(32)]
                    mirror = lambda e, m: [complex(acc[e][m][0][k] + mir[e][m][0][k], mir[e][m][1][k] - acc[e][m][1][k])
                                           for k in range(32)]
                    # Before: per e and lag, (i, j) and its mirror (j, i), one 8-byte store each.
                    for e in range(4):
                        i = i0 + g + (8 if e >= 2 else 0)
                        j = kTileCols * q + 2 * t4 + (e & 1)
                        ok = (i <= j) & (j < cig)
                        for m in range(lags):
                            d, t = direct(e, m), mirror(e, m)
                            old.store(np.where(ok, base + m * entries + i * cig + j, -1), [[v] for v in d],
                                      tid(e), 1, full_tile)
                            old.store(np.where(ok & (i < j), base + m * entries + j * cig + i, -1), [[v] for v in t],
                                      tid(e) + 1000000 * 4, 1, full_tile)  # its mirror: a distinct writer tag
                    # After: per h and lag, (i, j) and (i, j + 1) as one 16-byte store where i <= j,
                    # (i, j + 1) alone where i = j + 1, and the mirrors (j, i) where i < j, (j + 1, i) where i <= j.
                    for h in range(2):
                        i = i0 + g + 8 * h
                        j = kTileCols * q + 2 * t4
                        live = (i <= j + 1) & (j < cig)
                        pair, single = live & (i <= j), live & (i == j + 1)
                        for m in range(lags):
                            d0, d1, t0, t1 = direct(2 * h, m), direct(2 * h + 1, m), mirror(2 * h, m), mirror(2 * h + 1, m)
                            at = base + m * entries + i * cig + j
                            new.store(np.where(pair, at, -1), list(zip(d0, d1)),
                                      np.where(pair, tid(2 * h), -1), 2, full_tile)
                            # The 16-byte store tags both entries with e = 2h; fix the second's tag.
                            for k in np.nonzero(pair)[0]: new.who[at[k] + 1] = tid(2 * h + 1)[k]
                            new.store(np.where(pair & (i < j), base + m * entries + j * cig + i, -1),
                                      [[v] for v in t0], tid(2 * h) + 1000000 * 4, 1, full_tile)
                            new.store(np.where(pair, base + m * entries + (j + 1) * cig + i, -1),
                                      [[v] for v in t1], tid(2 * h + 1) + 1000000 * 4, 1, full_tile)
                            new.store(np.where(single, at + 1, -1), [[v] for v in d1], tid(2 * h + 1), 1, full_tile)
    flat_ref = ref.reshape(-1)
    for name, st in (("old", old), ("new", new)):
        assert (st.count == 1).all(), (name, cig, "entries written", np.bincount(st.count))
        err = np.abs(st.q - flat_ref).max() / np.abs(flat_ref).max()
        assert err < 1e-13, (name, cig, err)
    assert (new.who == old.who).all(), (cig, "a different thread or sum wrote an entry")
    assert np.array_equal(new.q, old.q), (cig, "values differ from the old mapping's")
    for sectors, _, full_tile in new.instructions:
        if full_tile: assert all(b == 32 for b in sectors.values()), (cig, "a partial sector in a whole tile")

    def stats(st):
        nsec = sum(len(s) for s, _, _ in st.instructions)
        nbytes = sum(b for _, b, _ in st.instructions)
        return len(st.instructions), nsec, nbytes / nsec
    return stats(old), stats(new), T


CASES = [(64, 1, 5), (64, 2, 7), (2, 2, 7), (6, 2, 7), (10, 2, 7), (24, 2, 7), (40, 2, 7),
         (34, 1, 5), (48, 1, 5), (128, 1, 5)]


def run(case):
    """One (channels per group, groups, lags) case: the model's asserts, and the new mapping
    uses no more store instructions or sectors than the old one."""
    cig, groups, lags_total = case
    (oi, osec, _), (ni, nsec, _), _ = model(cig, groups, lags_total)
    assert ni <= oi and nsec <= osec, (case, oi, ni, osec, nsec)
