"""The model: GPT2 (gpt2: parameters, training step, files, generation) over the C++ core, and its inference loop
(engine: the KV-cache engine, token streams, the slot pool that bounds cache memory)."""
from .gpt2 import (GPT2, DeviceError, NoGradientsError, as_tokens, check_group_lrs, check_loss_scale_args,  # noqa
                   check_muon_args, check_step_args, load_model, pick_precision)

__all__ = ["GPT2", "DeviceError", "NoGradientsError", "as_tokens", "check_group_lrs", "check_loss_scale_args",
           "check_muon_args", "check_step_args", "load_model", "pick_precision"]
