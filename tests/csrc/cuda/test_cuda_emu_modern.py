"""The modern architecture on the emulated CUDA backend (gpt2core_cuda_emu, see test_cuda_emu.py): until its
kernels land, the CUDA backend refuses a non-GPT-2 config at construction, with a message naming the
architecture and the way out (device='cpu'), in every precision; GPT-2 itself is unaffected."""
import pytest

from test_cuda_emu import CFG, emu  # noqa: F401  (emu: fixture)

ARCH = [dict(position="rope"), dict(norm="rmsnorm"), dict(qk_norm=True), dict(activation="relu2"), dict(bias=False),
        dict(tie_embeddings=False), dict(logit_softcap=15.0)]


@pytest.mark.parametrize("cls", ["Model", "ModelBF16", "ModelF16"])
@pytest.mark.parametrize("arch", ARCH, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_cuda_refuses_modern_config_until_implemented(emu, cls, arch):  # noqa: F811
    with pytest.raises(ValueError, match="not implemented on CUDA yet.*device='cpu'"):
        getattr(emu, cls)(**CFG, device="cuda", **arch)
    # the same config on the CPU backend of the same module builds, and GPT-2 on CUDA still does
    if cls == "Model":
        emu.Model(**CFG, device="cpu", **arch)
    getattr(emu, cls)(**CFG, device="cuda")
