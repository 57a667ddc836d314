"""experiments/mma_probe.py's tensor-core GEMV: its lanes' 16-byte reads placed into the
mma.m16n8k16 fragments must form the plain product (the kernel itself runs on a GPU only)."""

from experiments import mma_probe


def test_fragment_mapping_forms_the_product():
    assert mma_probe.selftest() == 0

