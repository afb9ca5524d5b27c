"""Forcing the CPU backend's instruction-set variant in-process (csrc/cpu/backend_cpu.h: set_cpu_isa picks the variant
that CPU backends created from then on use), for the tests of every variant: gpt2core._C and the emulator's test
module (tests/csrc/cuda) bind the same functions. A variant this CPU or build cannot run is skipped with the reason."""
import pytest

CPU_ISAS = ["baseline", "x86-64-v3", "x86-64-v4"]


def force_cpu_isa(core, name):
    """Makes `name` the variant of CPU backends created from now on in `core`; returns the one in use before."""
    if name not in core.cpu_isas():
        why = {"x86-64-v4": "no AVX-512 F/BW/DQ/VL", "x86-64-v3": "no AVX2 + FMA"}.get(name, "not compiled")
        pytest.skip(f"this CPU / build does not run the {name} variant ({why}; it runs {core.cpu_isas()})")
    before = core.cpu_isa()
    core.set_cpu_isa(name)
    return before
