"""Every constant of the cost model is named, has a source, and `megascale plan --explain` lists it."""

from megascale.plan import compute, search, step
from megascale.plan.constants import model_constants, profile_constants
from megascale.plan.hardware import PROFILES


def test_every_model_constant_has_a_source():
    constants = model_constants()
    names = {(c.module, c.name) for c in constants}
    expected = {
        ("compute", "FLOAT8_GRAD_CAST_BYTES"),
        ("step", "TP_OVERLAP_CHUNKS"),
        ("search", "MEMORY_HEADROOM"),
    }
    assert expected <= names
    assert all(c.source for c in constants), [c.name for c in constants if not c.source]
    # A pair under one comment shares it; a constant's own trailing comment wins.
    shared = {c.name: c.source for c in constants}
    assert shared["ELEMENTWISE_PASSES_FUSED"] == shared["ELEMENTWISE_PASSES_UNFUSED"]
    assert shared["MEMORY_HEADROOM"].startswith("of device memory usable")
    assert {c.name: c.value for c in constants}["TP_OVERLAP_CHUNKS"] == step.TP_OVERLAP_CHUNKS


def test_no_numeric_constant_of_a_model_module_is_left_out():
    listed = {c.name for c in model_constants()}
    for module in (compute, step, search):
        public = {
            name
            for name, value in vars(module).items()
            if name.isupper() and isinstance(value, int | float) and not isinstance(value, bool)
        }
        assert public <= listed, public - listed


def test_every_profile_number_is_described():
    for profile in (PROFILES["v100"], PROFILES["a100"], PROFILES["gb200"]):
        constants = profile_constants(profile)
        assert {"gemm_efficiency", "hbm_bytes_per_s", "network_efficiency"} <= {c.name for c in constants}
        assert all(c.source for c in constants)
