"""A model of csrc/cross_spectrum/cuda/cross_spectrum_s_stage_mma.cu's block plan (BlockPlan, locate, the staging's
channels and the warps' fragment offsets), checked for every even channel count per group
from 2 to 258: each entry (i, j) of S_f is written once, and every warp's A rows and B
columns read the staged channels they stand for.

    (run by tests/test_index_models.py)
"""
kWarps, kBlockRows, kTileCols, kStaged = 4, 16, 8, 48
def full_blocks(T, p):
    tiles = T - 2*p
    return tiles // kWarps if T % 2 == 0 else (tiles + kWarps - 1) // kWarps
def paired_blocks(T):
    if T % 2: return 0
    half = T // 2; first = (half - 1) % 2
    return ((half - first + 1) // 2 + 1) // 2
def blocks_per_row(T):
    return paired_blocks(T) + sum(full_blocks(T, p) for p in range(T) if 2*p < T)
def locate(y, T):
    p = 0
    while 2*p < T:
        n = full_blocks(T, p)
        if y < n: return ([p, -1], 2*p + kWarps*y, kBlockRows)
        y -= n; p += 1
    half = T // 2; first = (half - 1) % 2 + 4*y; second = first + 2
    return ([first, second if second < half else -1], T - 2, 2*kBlockRows)
def check(cig):
    T = (cig + kTileCols - 1) // kTileCols
    written = {}
    nb = blocks_per_row(T)
    idle = 0
    for y in range(nb):
        P, q0, rows_n = locate(y, T)
        j0 = kTileCols * q0
        def channel(slot):
            if slot < kBlockRows: ch = kBlockRows * P[0] + slot
            elif slot < rows_n: ch = kBlockRows * (P[1] - 1) + slot if P[1] >= 0 else -1
            else: ch = j0 + slot - rows_n
            return ch if 0 <= ch < cig else -1
        for warp in range(kWarps):
            paired = rows_n != kBlockRows
            side = warp // 2 if paired else 0
            p = P[side]
            q = q0 + (warp % 2 if paired else warp)
            active = p >= 0 and q < T
            if not active: idle += 1; continue
            rows = kBlockRows * side; col = rows_n + kTileCols * (q - q0) - rows
            assert q >= 2 * p, (cig, y, warp, p, q)
            for r in range(16):
                ch = channel(rows + r); want = 16*p + r
                assert ch == (want if want < cig else -1), ("A", cig, y, warp, r, ch, want)
            for c in range(8):
                ch = channel(rows + col + c); want = 8*q + c
                assert ch == (want if want < cig else -1), ("B", cig, y, warp, c, ch, want)
            for r in range(16):
                for c in range(8):
                    i, j = 16*p + r, 8*q + c
                    if i > j or j >= cig: continue
                    written[(i, j)] = written.get((i, j), 0) + 1
                    if i < j: written[(j, i)] = written.get((j, i), 0) + 1
    assert all(v == 1 for v in written.values()), cig
    assert len(written) == cig * cig, (cig, len(written))
    return nb, idle
def run():
    """Every even channel count per group from 2 to 258."""
    for cig in range(2, 260, 2):
        check(cig)
