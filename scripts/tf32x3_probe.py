"""Whether cuDNN's TF32 tensor cores can give float32-exact statistics for the padded layers'
training forward (docs/performance.md, Known gaps): the transposed convolution and its
convolution_backward in strict float32, TF32, error-compensated 3xTF32 (x = x_hi + x_lo, the
weight likewise, x_hi the TF32 rounding; the three products hi*hi, hi*lo, lo*hi as ONE TF32
convolution over 3 Ci concatenated channels) and float64, on the real-layer shapes: median
GPU time and relative errors against float64 (y and the batch variance; x's and the
weight's gradients).

    python scripts/tf32x3_probe.py [--bench]    (CUDA; --bench: cudnn.benchmark on)
"""
import statistics
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = "--bench" in sys.argv
dev = "cuda"
# name, B, Ci, Co, S, k, s, p, op
SHAPES = [
    ("k4s2p1-c64-s16-b8", 8, 64, 32, 16, 4, 2, 1, 0),
    ("k4s2p1-c128-s16-b16", 16, 128, 64, 16, 4, 2, 1, 0),
    ("k4s2p1-c256-s8-b32", 32, 256, 128, 8, 4, 2, 1, 0),
    ("k3s2p1op1-c64-s16-b4", 4, 64, 32, 16, 3, 2, 1, 1),
    ("k3s2p1op1-c256-s8-b32", 32, 256, 128, 8, 3, 2, 1, 1),
    ("k3s1p1-c64-s32-b4", 4, 64, 64, 32, 3, 1, 1, 0),
    ("k3s1p1-c128-s16-b16", 16, 128, 128, 16, 3, 1, 1, 0),
    ("k3s1p1-c256-s8-b32", 32, 256, 256, 8, 3, 1, 1, 0),
    ("deep-c512-s8-b8", 8, 512, 256, 8, 2, 2, 0, 0),
    ("seed", 16, 64, 128, 16, 5, 1, 0, 0),
]


def split(t):
    hi = (t.view(torch.int32) + 0x1000).bitwise_and_(-0x2000).view(torch.float32)
    return hi, t - hi


def timeit(fn, reps=15):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda._sleep(200000)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def tf32(flag):
    torch.backends.cudnn.allow_tf32 = flag


def fwd(x, w, s, p, op):
    return F.conv_transpose3d(x, w, stride=s, padding=p, output_padding=op)


def fwd3(x, w, s, p, op):
    xh, xl = split(x)
    wh, wl = split(w)
    return F.conv_transpose3d(torch.cat([xh, xh, xl], 1), torch.cat([wh, wl, wh], 0),
                              stride=s, padding=p, output_padding=op)


def bwd(dy, x, w, s, p, op, mask=(True, True, False)):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [s] * 3, [p] * 3, [1] * 3, True,
                                               [op] * 3, 1, list(mask))


def bwd3(dy, x, w, s, p, op):
    dh, dl = split(dy)
    xh, xl = split(x)
    wh, wl = split(w)
    # grad_x: pairs (dh,wh) (dl,wh) in one conv over 2Co, plus (dh,wl)
    gx = bwd(torch.cat([dh, dl], 1), x, torch.cat([wh, wh], 1), s, p, op, (True, False, False))[0]
    gx += bwd(dh, x, wl, s, p, op, (True, False, False))[0]
    # grad_w: groups=3 over channel concat
    X = torch.cat([xh, xh, xl], 1)
    D = torch.cat([dh, dl, dh], 1)
    Ci, Co = w.shape[0], w.shape[1]
    gw3 = torch.ops.aten.convolution_backward(D, X, w.repeat(3, 1, 1, 1, 1), None, [s] * 3, [p] * 3,
                                              [1] * 3, True, [op] * 3, 3, [False, True, False])[1]
    gw = gw3.view(3, Ci, Co, *w.shape[2:]).sum(0)
    return gx, gw


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


for name, B, Ci, Co, S, k, s, p, op in SHAPES:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, Ci, S, S, S, device=dev, generator=g) + 0.5
    w = torch.randn(Ci, Co, k, k, k, device=dev, generator=g) / (Ci * k ** 3 / s ** 3) ** 0.5
    y64 = fwd(x.double(), w.double(), s, p, op)
    v64 = y64.var((0, 2, 3, 4))
    dy = torch.randn_like(y64).float()
    gx64, gw64, _ = bwd(dy.double(), x.double(), w.double(), s, p, op)
    res = {}
    tf32(False); t_strict = timeit(lambda: fwd(x, w, s, p, op)); y = fwd(x, w, s, p, op)
    res["fwd fp32"] = (t_strict, rel(y, y64), rel(y.double().var((0, 2, 3, 4)), v64))
    tf32(True); t = timeit(lambda: fwd(x, w, s, p, op)); y = fwd(x, w, s, p, op)
    res["fwd tf32"] = (t, rel(y, y64), rel(y.double().var((0, 2, 3, 4)), v64))
    t = timeit(lambda: fwd3(x, w, s, p, op)); y = fwd3(x, w, s, p, op)
    res["fwd 3xtf32"] = (t, rel(y, y64), rel(y.double().var((0, 2, 3, 4)), v64))
    tf32(False)
    t = timeit(lambda: fwd(x.double(), w.double(), s, p, op), reps=5)
    res["fwd fp64"] = (t, 0, 0)
    t = timeit(lambda: bwd(dy, x, w, s, p, op)); gx, gw, _ = bwd(dy, x, w, s, p, op)
    res["bwd fp32"] = (t, rel(gx, gx64), rel(gw, gw64))
    tf32(True)
    t = timeit(lambda: bwd(dy, x, w, s, p, op)); gx, gw, _ = bwd(dy, x, w, s, p, op)
    res["bwd tf32"] = (t, rel(gx, gx64), rel(gw, gw64))
    t = timeit(lambda: bwd3(dy, x, w, s, p, op)); gx, gw = bwd3(dy, x, w, s, p, op)
    res["bwd 3xtf32"] = (t, rel(gx, gx64), rel(gw, gw64))
    tf32(False)
    print(name, flush=True)
    for kk, (t, e1, e2) in res.items():
        print(f"   {kk:12s} {t:8.3f} ms  err {e1:.1e} {e2:.1e}", flush=True)
    del y64, dy, gx64, gw64
    torch.cuda.empty_cache()
