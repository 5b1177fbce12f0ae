"""Build script for fused_ops: one ahead-of-time compiled extension, fused_ops._C.

The build needs no GPU. It finds the CUDA toolkit and the CUDA library headers
that pip-installed PyTorch depends on by itself, and falls back to a CPU-only
extension (with a notice) when no nvcc exists.
"""
import glob
import importlib.util
import json
import os
import shutil
import sys

from setuptools import find_packages, setup

DEFAULT_ARCH_LIST = "8.0;9.0+PTX"


def _has_toolkit(root):
    return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime_api.h")
    )


def find_cuda_home():
    """First of $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and nvcc's own tree that holds a toolkit.

    torch guesses CUDA_HOME from the directory above `which nvcc`, which is wrong when
    nvcc on PATH is a wrapper script (/usr/local/bin/nvcc), so it is set here first.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if _has_toolkit(root):
            return os.path.realpath(root)
    return None


def pip_cuda_include_dirs():
    """Include dirs of the nvidia-* wheels torch depends on (cuBLAS, cuSPARSE, cuFFT headers)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    dirs = []
    for root in spec.submodule_search_locations:
        dirs += sorted(glob.glob(os.path.join(root, "cu*", "include")))  # nvidia/cu13/include
        dirs += sorted(glob.glob(os.path.join(root, "*", "include")))  # older per-library layout
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


CUDA_HOME = find_cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME  # read by torch.utils.cpp_extension at import
if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def write_build_info(archs):
    """Header recording what this binary is built with, reported by `python -m fused_ops`.

    Returns the include dir that holds it (a header avoids quoting a string
    through the compiler command lines).
    """
    info = {"torch": torch.__version__, "cuda_toolkit": torch.version.cuda if archs else None, "cuda_archs": archs}
    gen_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "generated")
    os.makedirs(gen_dir, exist_ok=True)
    with open(os.path.join(gen_dir, "fused_ops_build_info.h"), "w") as f:
        f.write("#pragma once\n#define FUSED_OPS_BUILD_INFO %s\n" % json.dumps(json.dumps(info)))
    return gen_dir


def extension():
    here = os.path.dirname(os.path.abspath(__file__))
    # Every algorithm's folder: its host .cpp files in every build, its cuda/ folder's .cpp and
    # .cu files in a CUDA build (docs/design.md, file map).
    all_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True) + glob.glob("csrc/**/*.cu", recursive=True))
    device_only = [f for f in all_sources if "cuda" in f.split(os.sep)[1:-1]]
    common = [f for f in all_sources if f not in device_only and f.endswith(".cpp")]
    cxx_flags = ["-O3"]  # the C++ standard is the one torch's headers ask for
    include_dirs = [os.path.join(here, "csrc")]
    with_cuda = CUDA_HOME is not None and os.environ.get("FUSED_OPS_FORCE_CPU") != "1"
    include_dirs.append(write_build_info(os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else None))
    if not with_cuda:
        reason = "FUSED_OPS_FORCE_CPU=1" if CUDA_HOME else "no CUDA toolkit (nvcc) found"
        print(
            f"fused_ops: NOTICE: {reason}; building a CPU-only extension. "
            "Set CUDA_HOME to build the CUDA kernels.",
            file=sys.stderr,
        )
        return CppExtension(
            "fused_ops._C",
            common,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            )
    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    print(f"fused_ops: building CUDA kernels with CUDA_HOME={CUDA_HOME}, archs {archs}", file=sys.stderr)
    # CUDA's own include dir first so the toolkit's runtime headers win over the wheels'.
    include_dirs += [os.path.join(CUDA_HOME, "include")] + pip_cuda_include_dirs()
    sources = common + device_only
    return CUDAExtension(
        "fused_ops._C",
        sources,
        include_dirs=include_dirs,
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={
            "cxx": cxx_flags,
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
        },
    )


setup(
    packages=find_packages(include=["fused_ops", "fused_ops.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
