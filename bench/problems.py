"""The benchmark's problems: one record per problem, with its dims and conv options.

Two sweeps, each with a CUDA and a CPU list:

- seed: the seed problem, then one axis varied at a time (batch, channels, size, kernel,
  stride, padding): where the fused op's algorithms differ.
- real: the transposed convolutions that 3D decoders use (families below), each at several
  sizes, batch 1 to 32: what users would see.
"""
from typing import Dict, NamedTuple, Tuple, Union

Kernel = Union[int, Tuple[int, int, int]]


class Problem(NamedTuple):
    """x is [B, Ci, D, H, W]; ConvTranspose3d(Ci, Co, k, stride, padding, output_padding)."""
    B: int
    Ci: int
    Co: int
    D: int
    H: int
    W: int
    k: Kernel
    stride: int = 1
    padding: int = 0
    output_padding: int = 0

    @property
    def dims(self) -> tuple:
        """(B, Ci, Co, D, H, W, k), the shape part without the conv options."""
        return tuple(self[:7])

    @property
    def x_shape(self) -> tuple:
        return (self.B, self.Ci, self.D, self.H, self.W)

    def conv_options(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding)


# Seed sweep. Stride 2 (st2, up2, cpu_st2, cpu_up2) exercises the phases of the FFT and
# correlation paths (docs/math.md §3.3.1, §3.4); padding (pad2, t8pad1) the configurations
# that the FFT, correlation and cross-spectrum paths do not cover (`auto`: direct or
# sliced_conv).
SEED_CUDA: Dict[str, Problem] = {
    "seed": Problem(16, 64, 128, 16, 32, 32, 5),
    "b4": Problem(4, 64, 128, 16, 32, 32, 5),
    "b64": Problem(64, 64, 128, 16, 32, 32, 5),
    "c16": Problem(16, 16, 32, 16, 32, 32, 5),
    "c128": Problem(16, 128, 256, 16, 32, 32, 5),
    "s8": Problem(16, 64, 128, 8, 16, 16, 5),
    "s32": Problem(8, 64, 128, 32, 32, 32, 5),
    "k3": Problem(16, 64, 128, 16, 32, 32, 3),
    "odd": Problem(3, 5, 7, 9, 11, 13, (2, 3, 4)),
    "t8": Problem(8, 16, 16, 8, 8, 8, 3),    # small problems between odd and s8, where launch
    "t8c32": Problem(8, 32, 32, 8, 8, 8, 3),  # latency rather than work decides
    "t8c64": Problem(8, 64, 64, 8, 8, 8, 3),  # and two more between t8c32 and s8, where the
    "t8k5": Problem(8, 32, 32, 8, 8, 8, 5),   # direct kernel and the FFT path cross (CUDA auto)
    "st2": Problem(8, 32, 64, 16, 16, 16, 4, stride=2),
    "up2": Problem(8, 64, 32, 16, 16, 16, 2, stride=2),  # a decoder's upsampling: kernel = stride
    "pad2": Problem(16, 64, 128, 16, 32, 32, 5, padding=2),  # seed with same-size output
    "t8pad1": Problem(8, 32, 32, 8, 8, 8, 3, padding=1),     # t8c32 with padding 1
}
SEED_CPU: Dict[str, Problem] = {
    "cpu_small": Problem(4, 16, 32, 8, 16, 16, 3),
    "cpu_mid": Problem(8, 32, 64, 8, 16, 16, 5),
    "cpu_st2": Problem(4, 16, 32, 8, 8, 8, 4, stride=2),
    "cpu_up2": Problem(4, 32, 16, 8, 8, 8, 2, stride=2),
}


class Family(NamedTuple):
    """A kind of decoder layer: kernel and conv options, and Co as a fraction of Ci."""
    k: int
    stride: int
    padding: int
    output_padding: int
    co_divisor: int  # Co = Ci // co_divisor: decoders halve the channels as they upsample


FAMILIES: Dict[str, Family] = {
    "k2s2": Family(2, 2, 0, 0, 2),        # kernel = stride upsampling (3D U-Net, V-Net)
    "k4s2p1": Family(4, 2, 1, 0, 2),      # GAN-style upsampling (DCGAN-like 3D generators)
    "k3s2p1op1": Family(3, 2, 1, 1, 2),   # exact 2x with an odd kernel (output_padding 1)
    "k3s1p1": Family(3, 1, 1, 0, 1),      # "same" convolution, no upsampling
    "deep": Family(2, 2, 0, 0, 2),        # the bottleneck of a deep decoder: 512 -> 256 at 8^3
    "wide": Family(4, 2, 1, 0, 2),        # the high-resolution end: few channels, large grid
    "unet": Family(3, 2, 1, 1, 2),        # MONAI UNet's up-blocks (k3 s2 p1 op1), a 96^3 patch
    "vae": Family(4, 2, 1, 0, 1),         # VQ-VAE-style 3D decoders: k4 s2 p1, channels kept
}


def layer(family: str, ci: int, size: int, batch: int) -> Tuple[str, Problem]:
    """The problem named like `k4s2p1-c64-s16-b8`: family, Ci, input size (cubic), batch."""
    f = FAMILIES[family]
    name = f"{family}-c{ci}-s{size}-b{batch}"
    return name, Problem(batch, ci, ci // f.co_divisor, size, size, size, f.k,
                         stride=f.stride, padding=f.padding, output_padding=f.output_padding)


# Sizes are picked so that each row's eager call is between about 20 µs and 20 ms on an H100
# (launch-bound at the small end, memory- or compute-bound at the large one) and the whole
# real sweep stays within a few minutes.
REAL_CUDA: Dict[str, Problem] = dict(layer(*spec) for spec in (
    ("k2s2", 32, 16, 1), ("k2s2", 128, 16, 8), ("k2s2", 256, 8, 16), ("k2s2", 32, 32, 32),
    ("k4s2p1", 32, 8, 1), ("k4s2p1", 64, 16, 8), ("k4s2p1", 128, 16, 16), ("k4s2p1", 256, 8, 32),
    ("k3s2p1op1", 32, 8, 2), ("k3s2p1op1", 64, 16, 4), ("k3s2p1op1", 128, 16, 16),
    ("k3s2p1op1", 256, 8, 32),
    ("k3s1p1", 32, 16, 1), ("k3s1p1", 64, 32, 4), ("k3s1p1", 128, 16, 16), ("k3s1p1", 256, 8, 32),
    ("deep", 512, 8, 1), ("deep", 512, 8, 8), ("deep", 512, 8, 32),
    ("wide", 64, 32, 1), ("wide", 64, 32, 8), ("wide", 32, 64, 1),
    ("unet", 64, 48, 2),
    ("vae", 128, 16, 4),
))
# Small enough for a 2-core CPU in bfloat16 as well; kernel = stride is cpu_up2 already.
REAL_CPU: Dict[str, Problem] = dict(layer(*spec) for spec in (
    ("k4s2p1", 16, 8, 2), ("k3s2p1op1", 16, 8, 2), ("k3s1p1", 16, 8, 2),
))

SWEEPS = {"seed": {"cuda": SEED_CUDA, "cpu": SEED_CPU},
          "real": {"cuda": REAL_CUDA, "cpu": REAL_CPU}}
ALL_PROBLEMS: Dict[str, Problem] = {**SEED_CUDA, **SEED_CPU, **REAL_CUDA, **REAL_CPU}


def default_problems(sweep: str, device: str) -> Dict[str, Problem]:
    return SWEEPS[sweep][device]
