"""The Triton kernels the GPU routes launch, compiled offline for sm_80 and sm_90 (Triton's compiler and the
wheel's ptxas; no GPU) as the launches specialise them: no register spills, and room for at least 2 programs per
SM. A representative subset (the heaviest launches at OLMo's v = 50,280, not a multiple of 16, and u = 512 and 4,096);
bench/kernel_resources.py compiles the whole grid into bench/kernel_resources.md."""
import shutil
from pathlib import Path

import pytest

import bench.kernel_resources as kr
from s2t2_dist.ot.dykstra_triton import STRIDED_ROWS

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def test_the_capture_sees_every_launch_of_the_routes():
    """Forward + backward of 3 iterations, the sharded rows' thresholds and the product: 12 + 1 + 2 launches of
    four kernels, in ten specialisations."""
    launches = kr.capture(50280, 512)
    assert len(launches) == 15
    assert {la.kernel for la in launches} == {"project", "backward", "live_product", "live_grad_p"}
    assert len({la.role for la in launches}) == 10, sorted({la.role for la in launches})


def test_programs_per_sm_follow_the_sm_limits():
    assert kr.programs_per_sm(90, 255, 8, 1024) == 1  # the row projection before the 2,048-entry tiles
    assert kr.programs_per_sm(90, 128, 8, 1024) == 2 and kr.programs_per_sm(90, 129, 8, 1024) == 1
    assert kr.programs_per_sm(80, 32, 8, 100_000) == 1  # shared memory bound


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(str(PTXAS)) is None, reason="the triton wheel has no ptxas here")
@pytest.mark.parametrize("arch", [80, 90])
def test_the_heaviest_launches_do_not_spill_and_fit_two_programs_per_sm(arch):
    heavy = ("row projection (with corrections)", "row backward (with gc)")  # (the two that spilled)
    rows = kr.measure([50280], [512, 4096], [arch], only=lambda role: role in heavy, log=lambda s: None)
    assert {r["role"] for r in rows} == set(heavy) and len(rows) == 4
    # rows of 4,096 are streamed several a program (tiles of 16 x 64 spilled on sm_80 there)
    assert {r["launch"]["BS"] for r in rows if r["u"] == 4096} == {STRIDED_ROWS}
    for r in rows:
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["programs_per_sm"] >= 2, r
