"""The CUDA kernels' index and plan arithmetic, modelled in numpy on the CPU (tests/index_models/):
which thread reads and writes which entry, which blocks cover what, against plain formulas.
A change to a kernel's plan that breaks its coverage fails here without a GPU; the CUDA tests
check the kernels themselves."""
import pytest

from index_models import (contraction_mma, spectral_energy, tap_spectrum, w_stage_plan,
                          w_stage_store, x_spectrum_split)


def test_s_stage_mma_block_plan_covers_every_entry_once():
    """cross_spectrum_s_stage_mma.cu's BlockPlan: every even channel count per group from 2
    to 258, each entry of S_f written once, every fragment on the channels it stands for."""
    w_stage_plan.run()


@pytest.mark.parametrize("case", w_stage_store.CASES, ids=str)
def test_s_stage_mma_stores(case):
    """Its stores of Q: each entry once, by the thread and sums the reference mapping uses,
    16-byte stores aligned, whole sectors outside the diagonal and partial tiles."""
    w_stage_store.run(case)


@pytest.mark.parametrize("case", tap_spectrum.CASES, ids=str)
def test_tap_spectrum_bins(case):
    """cross_spectrum_tap_spectrum.cu: the taps' spectra on the 2k' - 1 grid, WeightTaps and
    StackTaps, against numpy's FFT."""
    tap_spectrum.run(case)


@pytest.mark.parametrize("case", x_spectrum_split.H_STAGE_CASES, ids=str)
def test_x_spectrum_h_stage(case):
    x_spectrum_split.run_h_stage(case)


@pytest.mark.parametrize("case", x_spectrum_split.SPECTRUM_CASES, ids=str)
def test_x_spectrum_stages(case):
    """x_spectrum_dft.cu's tables and W, H and D stages against numpy's rfftn."""
    x_spectrum_split.run_spectrum(case)


@pytest.mark.parametrize("case", contraction_mma.CASES, ids=str)
def test_quad_form_mma_contraction(case):
    """cross_spectrum_quad_form_mma.cu: blocks, staging, fragments and the epilogue against
    the complex formula, each partial sum written once."""
    contraction_mma.run(case)


@pytest.mark.parametrize("case", spectral_energy.CASES, ids=lambda c: c.name)
def test_fft_small_kernel(case):
    """fft_spectral_energy.cu's small-problem kernel against numpy's FFTs and the centred
    energy of the convolution, in float64 and float32."""
    spectral_energy.run(case)
