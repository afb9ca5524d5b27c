"""GPT2: the Python face of the C++ model (`gpt2core._C.Model`).

Parameters and gradients are numpy views into the core's buffers (no copies): `model.params["wte"]`
is the (padded_vocab_size, n_embd) token embedding, and writing into it changes the model.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from .. import _C
from ..config import GPT2Config, TrainConfig, get_preset
from .. import cli
from ..errors import ArgError, Error
from .checks import (_grad_scale, check_group_lrs, check_loss_scale_args,  # noqa: F401
                     check_muon_args, check_step_args)
from .files import Files
from .generation import Generation
from .sharding import FlatBuffers
from .threads import locked as _locked

# the tensors that are residual projections: init scaled by 1/sqrt(2 * n_layer) (GPT-2 paper, sec. 2.3)
_RESIDUAL_PROJ = ("attprojw", "fcprojw")
_MATRICES = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw", "lm_head")
# zero_init_proj: these start at zero (the residual projections and an untied head)
_ZERO_INIT = ("attprojw", "fcprojw", "lm_head")
_LN_WEIGHTS = ("ln1w", "ln2w", "lnfw")


class DeviceError(Error, RuntimeError):
    """The requested device is not usable (no CUDA backend compiled, or no GPU present)."""


class NoGradientsError(Error, RuntimeError):
    """step() with no gradients to apply (no backward since construction or zero_grad)."""


class _ShardedGrads(dict):
    """grads of a model whose gradients are sharded (ZeRO-2): no full views to give."""

    def __init__(self, lo: int, hi: int):
        super().__init__()
        self.range = (lo, hi)

    def __getitem__(self, name):
        raise ValueError(f"the gradients are sharded (ZeRO-2): this model holds flat {list(self.range)} only "
                         "(model._m.grad_shard())")


class _Views(dict):
    """params / grads: numpy views into the core's buffers. Writing into a view changes the model
    (`params["wte"][...] = w`); replacing an entry would only detach the name from the model, so it is refused."""

    def __setitem__(self, name, value):
        if name in self and value is dict.__getitem__(self, name):
            return  # `params[name] += x`: numpy updated the view in place, and Python stores the same object back
        raise TypeError(f"{name!r} is a view of the model's buffer and cannot be replaced: write into it in place "
                        f"(model.params[{name!r}][...] = value, then model.params_changed())")

    def __delitem__(self, name):
        raise TypeError(f"{name!r} is a view of the model's buffer and cannot be removed")

    def _refuse(self, *a, **k):
        raise TypeError("the model's parameter and gradient views cannot be replaced or removed: write into them "
                        "in place")

    update = setdefault = pop = popitem = clear = _refuse


def _check_device(device: str) -> str:
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        from .. import _libs, _plugins
        try:  # this build's CUDA module or the installed plugin's (gpt2core-cuda12 / gpt2core-cuda13)
            backend = _plugins.find()
        except _plugins.PluginError as e:
            raise DeviceError(f"device={device!r}: {e}") from None
        if backend is None:
            raise DeviceError(
                f"device={device!r}: {_plugins.why_none()}. Use device='cpu', or build from source on a machine with "
                "a CUDA compiler: GPT2CORE_CUDA=ON pip install --no-build-isolation . (docs/install.md: Build options).")
        # the driver first: without this, a missing or too old driver surfaces as cudart's "CUDA driver version
        # is insufficient for CUDA runtime version", which names neither the cause nor the fix
        why = _libs.driver_problem() or _C.cuda_status()  # "" when the CUDA backend can run here
        if why:
            raise DeviceError(f"device={device!r}: {why}. Use device='cpu' on this machine.")
        cli.device.check(device, "device")  # 'cuda' or 'cuda:N'
        if not cli.cuda_index_exists(int(device.partition(":")[2] or 0)):
            raise DeviceError(f"device={device!r}: no such GPU on this machine")
        return device
    raise ArgError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def pick_precision(precision: str | None, capability: int, dtype: str = "float32") -> str:
    """The precision a CUDA model of this dtype runs in on a GPU of compute capability `capability`
    (major*10+minor). None picks bf16 where bf16 tensor cores exist (sm_80+: A100, A10, L4, H100), fp16 where
    only fp16 tensor cores do (sm_70 / sm_75: V100, T4, RTX 20xx), else fp32 (P100 and older). bf16 and tf32
    asked for below sm_80 are refused, as is fp16 below sm_70: the GPU lacks them."""
    if precision is None:
        if dtype != "float32":
            return "fp32"
        return "bf16" if capability >= 80 else "fp16" if capability >= 70 else "fp32"
    if precision in ("bf16", "tf32") and capability < 80:
        fallback = "'fp16'" if capability >= 70 else "'fp32'"
        raise DeviceError(f"precision={precision!r} needs an sm_80+ GPU (A100, A10, L4, H100); this one is "
                          f"sm_{capability}: use precision={fallback} (or None, which picks it)")
    if precision == "fp16" and capability < 70:
        raise DeviceError(f"precision='fp16' needs fp16 tensor cores (sm_70+: V100, T4, RTX 20xx); this one is "
                          f"sm_{capability}: use precision='fp32' (or None, which picks it)")
    return precision


FP8_ARCHS = (89, 90)  # FP8 tensor cores with fp32 accumulation: Ada (RTX 40xx, L4, L40) and Hopper (H100, H200)


def check_fp8_device(device: str) -> None:
    """DeviceError naming the device unless it has FP8 tensor cores (sm_89, sm_90): precision='fp8'."""
    if device == "cpu":
        raise DeviceError("precision='fp8' needs an NVIDIA GPU with FP8 tensor cores, sm_89 (RTX 40xx, L4, L40) or "
                          "sm_90 (H100, H200); device 'cpu' has none: use precision 'fp32' on the CPU")
    index = int(device.partition(":")[2] or 0)
    cap = _C.cuda_capability(index)
    if cap not in FP8_ARCHS:
        raise DeviceError(f"precision='fp8' needs FP8 tensor cores, sm_89 (RTX 40xx, L4, L40) or sm_90 (H100, "
                          f"H200); {device} is {_C.cuda_device_name(index)}, sm_{cap}: use precision='bf16' or None")


def as_tokens(a, name: str) -> np.ndarray:
    """Integer array-like -> C-contiguous int32 (B, T), the form the core reads. The ids themselves (0..V-1; in
    targets also -1 or -100 for an ignored position) are validated once, by the core's binding; this only makes sure the cast to int32
    cannot wrap a wider id into a valid-looking one."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"{name} must have shape (B, T), got {arr.shape}")
    out = np.ascontiguousarray(arr, dtype=np.int32)
    if out.dtype != arr.dtype and not np.array_equal(out, arr):
        raise ValueError(f"{name} contains ids beyond the int32 range (up to {int(arr.max())})")
    return out


class GPT2(Generation, Files, FlatBuffers):
    """GPT-2 (pre-LN, tanh GELU, tied lm_head) trained by the C++ core; or, by the config's architecture fields
    (GPT2Config.modern), the speedrun-era model: rotary positions, RMSNorm, QK-norm, ReLU^2, no biases, an untied
    head, zero-initialised projections, soft-capped logits. `params` holds exactly the tensors the config has.

    >>> model = GPT2("tiny", seed=0)
    >>> loss = model.forward(x, y); model.backward(); norm = model.step(lr=1e-3)
    """

    def __init__(self, config: GPT2Config | str = "d12", device: str = "cpu", seed: int = 0,
                 dtype: str = "float32", init: bool = True, precision: str | None = None,
                 attention: str | None = None, fused: bool = True, matmul_tuning: bool = False,
                 deterministic: bool = True, loss_scaling: bool | None = None, loss_scale_init: float = 2.0**16,
                 loss_scale_interval: int = 2000, training: bool = True, fp8_head: bool = False):
        """precision: "fp32"; "tf32" (CUDA: TF32 tensor-core matmuls); "bf16" (CUDA: bf16 weights copy and
        activations, fp32 master weights, gradients, AdamW state, softmax and loss); "fp16" (CUDA: the same in
        IEEE half precision, for sm_70 / sm_75 GPUs; trained with dynamic loss scaling by default, below); "fp8"
        (sm_89 / sm_90 GPUs: bf16 as above, with the four Linear layers of every block multiplied in FP8 through
        cuBLASLt, e4m3 activations and weights forward, e5m2 gradients backward, fp32 accumulation, per-tensor
        power-of-two scales from each tensor's current amax; fp8_head=True multiplies the head in FP8 too; n_embd,
        B*T and, with the head, padded_vocab_size must be multiples of 16). None
        picks bf16 on a GPU with bf16 tensor cores (sm_80+), fp16 on sm_70 / sm_75 (V100, T4, which refuse bf16
        and tf32), fp32 below. attention (CUDA): "auto" (default: cuDNN's
        fused attention for bf16 when it checks out, else "flash"), "flash" (never materialises T x T), "cudnn"
        or "naive" (the materialised rung of the speed ladder); the CPU backend always materialises attention.
        fused (CUDA): residual + layernorm in one kernel and GELU in the matmul epilogues (False: the separate
        kernels, the unfused rung of the speed ladder; the CPU backend has nothing to fuse). matmul_tuning (CUDA):
        time cuBLASLt's candidate algorithms once per matmul shape and keep the fastest (as PyTorch's
        cudnn.benchmark); the choice is per process, so a resumed run may round differently from the run it
        continues: the default, False, takes cuBLASLt's heuristic's first and keeps resume bit-exact.
        deterministic (CUDA, default True): the same bits for the same inputs, so identical runs and resumed ones
        agree bit for bit; False lets cuDNN's attention backward accumulate dQ with atomics (its Hopper path), which
        may be faster but rounds differently from run to run. All of these are this model's own: two models in one
        process may differ.

        loss_scaling: dynamic loss scaling as PyTorch's GradScaler does it, on the device (see step()): True,
        False, or None (default: on for precision="fp16" only, whose gradients would underflow without it; it
        works on every backend and precision, so also on the CPU, where it is off unless asked for).
        loss_scale_init (default 2**16) is the first scale; after loss_scale_interval (default 2000) steps in a
        row without overflow it doubles, and each overflow halves it.

        training=False: an inference-only model (what load_model gives by default): no gradients, AdamW moments or
        backward activations are allocated; forward (through the KV-cache path), generate and evaluation work,
        backward / step raise."""
        if isinstance(config, str):
            config = get_preset(config)
        elif not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config or a preset name, got {type(config).__name__} {config!r}"
                            + ("; GPT2Config(**config) makes one from a dict" if isinstance(config, dict) else ""))
        self.config = config
        if precision not in (None, "fp32", "tf32", "bf16", "fp16", "fp8"):
            raise ValueError(f"precision must be 'fp32', 'tf32', 'bf16', 'fp16' or 'fp8', got {precision!r}")
        if fp8_head not in (True, False):
            raise ValueError(f"fp8_head must be True or False, got {fp8_head!r}")
        if fp8_head and precision != "fp8":
            raise ValueError(f"fp8_head=True multiplies the head in FP8: it needs precision='fp8', got {precision!r}")
        if precision == "fp8":
            check_fp8_device(_check_device(device))
            bad = [f"{k}={v}" for k, v in (("n_embd", config.n_embd),
                                           ("padded_vocab_size", config.padded_vocab_size if fp8_head else 16))
                   if v % 16]
            if bad:
                raise ValueError(f"precision='fp8': {', '.join(bad)} must be a multiple of 16 (cuBLASLt's FP8 "
                                 "matmuls take inner dimensions in multiples of 16)")
        if attention not in (None, "auto", "flash", "cudnn", "naive"):
            raise ValueError(f"attention must be 'auto', 'flash', 'cudnn' or 'naive', got {attention!r}")
        if device == "cpu" and (precision not in (None, "fp32") or attention in ("flash", "cudnn")):
            raise ValueError(f"precision={precision!r}, attention={attention!r}: the CPU backend computes in "
                             "fp32 with materialised attention; TF32, bf16, fp16, flash and cuDNN attention need "
                             "device='cuda'")
        self.device = _check_device(device)
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64' (float64 is for tests), got {dtype!r}")
        if self.device != "cpu":
            precision = pick_precision(precision, _C.cuda_capability(int(self.device.partition(":")[2] or 0)), dtype)
        precision = precision or "fp32"
        if attention == "cudnn" and precision in ("fp32", "tf32"):
            raise ValueError(f"attention='cudnn' needs precision='bf16' or 'fp16' (cuDNN's fused attention has no fp32 "
                             f"inputs); this model is precision={precision!r}: use attention='flash' or a 16-bit "
                             "precision")
        if precision in ("bf16", "fp16", "fp8") and dtype != "float32":
            raise ValueError(f"precision={precision!r} keeps float32 master weights: use dtype='float32'")
        self.precision = precision
        cls = {"float64": _C.ModelF64,
               "float32": {"bf16": _C.ModelBF16, "fp8": _C.ModelBF16, "fp16": _C.ModelF16}.get(precision,
                                                                                               _C.Model)}[dtype]
        c = config
        self._m = cls(max_seq_len=c.block_size, vocab_size=c.vocab_size, padded_vocab_size=c.padded_vocab_size,
                      n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, device=self.device,
                      tf32=precision == "tf32", attention=attention or "auto", fused=bool(fused),
                      matmul_tuning=bool(matmul_tuning), training=bool(training), deterministic=bool(deterministic),
                      position=c.position, rope_base=float(c.rope_base),
                      norm=c.norm, qk_norm=c.qk_norm, activation=c.activation, bias=c.bias,
                      tie_embeddings=c.tie_embeddings, logit_softcap=float(c.logit_softcap or 0.0))
        self._adopt(self._m, config, self.device, precision, training, deterministic)
        if precision == "fp8":  # bf16 mixed precision, the block Linears (and the head) in FP8 (csrc/model/fp8.h)
            self._m.set_fp8(True, head=bool(fp8_head))
        if loss_scaling not in (None, True, False):
            raise ValueError(f"loss_scaling must be True, False or None (on for fp16 only), got {loss_scaling!r}")
        check_loss_scale_args(loss_scale_init, loss_scale_interval)
        if loss_scaling is None:
            loss_scaling = precision == "fp16"
        self._m.set_loss_scaling(bool(loss_scaling), scale=float(loss_scale_init), interval=int(loss_scale_interval))
        if init:
            self.init_weights(seed)

    def _adopt(self, core, config: GPT2Config, device: str, precision: str, training: bool = True,
               deterministic: bool = True) -> "GPT2":
        """Make this GPT2 the wrapper of `core` (a backend's Model object): every attribute the methods read is
        set here, the one place, so a test can wrap another backend's core (the CUDA emulator's) as __init__
        wraps the compiled one: `GPT2.__new__(GPT2)._adopt(core, config, "cuda", "fp32")`."""
        self.config, self.device, self.precision, self._m = config, device, precision, core
        self.training = bool(training)
        self.deterministic = bool(deterministic)
        self.params: dict[str, np.ndarray] = _Views(core.params())
        self.grads: dict[str, np.ndarray] = _Views(core.grads())
        self._has_grads = False  # a backward since construction / zero_grad (step() refuses to apply none)
        self.step_count = 0
        return self

    # ------------------------------------------------------------------ sharing between threads
    @property
    def lock(self) -> threading.RLock:
        """The model's lock. Every call that uses the model's buffers (forward, backward, forward_backward, step,
        zero_grad, take_loss, token_losses, init_weights, params_changed, each step of generate, evaluation) holds
        it, so threads sharing one model run their calls one after another, each with the result it would have
        alone; a second thread waits. Hold it yourself to make a sequence of calls atomic, e.g. a forward and the
        token_losses() of that forward: `with model.lock: model.forward(x, y); l = model.token_losses()`
        (re-entrant). Writing into self.params from one thread while another computes is a race, as in PyTorch."""
        lock = self.__dict__.get("_lock")
        return lock if lock is not None else self.__dict__.setdefault("_lock", threading.RLock())

    # ------------------------------------------------------------------ parameters
    @property
    def num_parameters(self) -> int:
        return self._m.num_parameters

    @_locked
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 init: N(0, 0.02) matrices and embeddings (an untied lm_head too), residual projections scaled
        by 1/sqrt(2*n_layer), zero biases, LayerNorm weight 1 and bias 0, padded vocab rows zero; with
        zero_init_proj the residual projections and an untied lm_head start at zero (their random draws are still
        taken, so the other tensors get the same weights either way).
        Reproducible: the same seed gives the same weights on every machine (numpy's PCG64)."""
        rng = np.random.default_rng(cli.non_negative_int.check(seed, "seed"))
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.params.items():  # layout order, fixed, so the random stream is stable
            if name in _MATRICES:
                tmp = rng.standard_normal(p.shape, dtype=np.float32)
                p[...] = tmp * (std_resid if name in _RESIDUAL_PROJ else 0.02)
                if self.config.zero_init_proj and name in _ZERO_INIT:
                    p[...] = 0.0
            elif name in _LN_WEIGHTS:
                p[...] = 1.0
            else:
                p[...] = 0.0
        self.params["wte"][self.config.vocab_size:] = 0.0
        if "lm_head" in self.params:
            self.params["lm_head"][self.config.vocab_size:] = 0.0
        self.params_changed()
        self.step_count = 0

    @_locked
    def params_changed(self) -> None:
        """Call after writing into self.params in place. In bf16 / fp16 the ops read a 16-bit copy of these (fp32
        master) weights, rebuilt from them before the next forward; in fp32 this does nothing."""
        self._m.params_changed()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (AdamW bias correction; in bf16 also the seed of the weights' stochastic
        rounding, so a resumed run rebuilds exactly the bf16 weights an uninterrupted one has)."""
        return self._step_count

    @step_count.setter
    def step_count(self, step: int) -> None:
        self._step_count = int(step)
        if self._m.param_round_seed != self._step_count:
            self._m.param_round_seed = self._step_count

    # ------------------------------------------------------------------ loss scaling
    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling is on (see __init__ and step())."""
        return self._m.loss_scaling

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when loss scaling is off): self.grads hold this times the gradients."""
        return self._m.loss_scaler["scale"]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far for an overflow (inf/NaN gradients) under loss scaling."""
        return self._m.loss_scaler["skipped"]

    def loss_scaler_state(self) -> dict | None:
        """The loss scaler's state {scale, clean, skipped} (clean: steps in a row without overflow since the
        scale last changed; skipped: in total), None when loss scaling is off. What checkpoints save."""
        if not self.loss_scaling:
            return None
        d = self._m.loss_scaler
        return {"scale": d["scale"], "clean": d["clean"], "skipped": d["skipped"]}

    @_locked
    def load_loss_scaler_state(self, state: dict | None) -> None:
        """Continue from a saved loss_scaler_state(). With loss scaling off the state is ignored (an fp16 run's
        checkpoint continuing in fp32 needs no scale); None (a checkpoint of a run without scaling) leaves the
        scaler at its initial scale."""
        if state is None or not self.loss_scaling:
            return
        interval = self._m.loss_scaler["interval"]
        self._m.set_loss_scaling(True, scale=float(state["scale"]), interval=interval, clean=int(state["clean"]),
                                 skipped=int(state["skipped"]))

    @property
    def recompute(self) -> str:
        """What backward recomputes instead of keeping from forward: 'none'; 'gelu' (one activation-output buffer,
        refilled per layer: saves (L-1)*B*T*4C values for one extra GELU per layer); 'layer' (only each block's
        input is kept, and backward runs each block's forward again just before its backward: one more forward of
        the blocks). 'layer' gives 'none''s bits; so does 'gelu', except on CUDA with fused=True and GPT-2's GELU,
        where its forward uses gpt2core's GELU kernel instead of cuBLASLt's epilogue (which backward could not
        rebuild): the last bits differ from 'none''s (docs/training/memory.md)."""
        return self._m.recompute

    @recompute.setter
    def recompute(self, level: str) -> None:
        if level not in ("none", "gelu", "layer"):
            raise ValueError(f"recompute must be 'none', 'gelu' or 'layer', got {level!r}")
        self._m.recompute = level

    @property
    def offload(self) -> bool:
        """Optimizer offload (device 'cuda', --offload optimizer): the fp32 master weights and the AdamW moments
        live in pinned host memory, and step() sums the gradients' squares on the GPU, copies the gradients to the
        host, runs AdamW on the host's cores with the GPU kernel's own arithmetic and writes the new weights back:
        the same bits as the update on the GPU, for 12 bytes a parameter less GPU memory (16-bit models; 8 for
        fp32). AdamW only."""
        return self._m.offload

    @offload.setter
    def offload(self, on: bool) -> None:
        if self.device == "cpu" and on:
            raise ValueError("offload is for a GPU (device 'cuda'): on the CPU the optimizer state is in host "
                             "memory already")
        self._m.offload = bool(on)
        self.params = _Views(self._m.params())  # a 16-bit model's master weights moved: views of where they are

    def prefetch_grads(self) -> None:
        """With offload, in one process: the next backward (or forward_backward) is the optimizer step's last
        micro-step, so each group of gradients it finishes (the head's, each layer's, the embeddings') is copied to
        the host at once on a second stream, overlapped with the rest of backward, and step() does not copy them
        again (gpt2core-train calls it before the last micro-step). The same bits either way, provided nothing
        writes the gradients between that backward and step() (zero_grad() or another backward cancels the copy).
        Not under DataParallel: its ranks change the gradients after backward (the average over ranks)."""
        if getattr(self, "_data_parallel", False):
            raise RuntimeError("prefetch_grads: this model is trained by DataParallel, whose averaging over the ranks "
                               "changes the gradients after backward; the step copies them instead")
        self._m.prefetch_grads()

    def shard_grads(self, lo: int, hi: int) -> None:
        """ZeRO-2 (DataParallel(zero=2) calls it): keep only the gradients of flat [lo, hi) plus the bucket buffers
        backward fills (the core's set_grad_shard); self.grads then refuses, naming the shard (the core's
        grad_shard() is its view). (0, num_parameters) goes back to one full buffer."""
        self._m.set_grad_shard(lo, hi)
        self.grads = _Views(self._m.grads()) if not self._m.grad_sharded else _ShardedGrads(lo, hi)

    @property
    def recompute_gelu(self) -> bool:
        """recompute == 'gelu' (the older switch for that level)."""
        return self._m.recompute_gelu

    @recompute_gelu.setter
    def recompute_gelu(self, on: bool) -> None:
        self._m.recompute_gelu = bool(on)

    def memory_report(self, B: int, T: int) -> dict:
        """Bytes of parameters, gradients, AdamW state and activations for micro-batch (B, T)."""
        d = dict(self._m.memory_bytes(B, T))
        d["total"] = sum(d.values())
        return d

    def opt_state(self) -> tuple[dict, dict]:
        """AdamW first and second moments by name (numpy views)."""
        return self._m.adam_m(), self._m.adam_v()

    # ------------------------------------------------------------------ compute
    def forward(self, idx, targets=None, return_logits: bool = False):
        """Mean cross-entropy of predicting targets from idx (NaN without targets); with return_logits
        also the logits (B, T, padded_vocab_size) as a new array.

        targets are the next tokens, already shifted: targets[b, t] is the token that follows idx[b, t]
        (tokens[:, 1:] for idx = tokens[:, :-1]), not a copy of idx as Hugging Face's `labels` are.
        Positions whose target is -1 or -100 (Hugging Face's ignore index) are left out of the mean."""
        x = as_tokens(idx, "idx")
        y = None if targets is None else as_tokens(targets, "targets")
        with self.lock:
            if self.training or not getattr(self._m, "kv_supported", False):
                loss = self._m.forward(x, y)
            else:  # inference-only: a prefill into KV-cache slots no stream owns (gpt2_infer.h kv_forward)
                from . import engine
                pool = engine.SlotPool.of(self)
                slots = pool.acquire(x.shape[0], x.shape[1], self.config)
                try:
                    loss = self._m.forward(x, y, slots=np.asarray(slots, dtype=np.int32))
                finally:
                    pool.release(slots)
            if return_logits:
                return loss, self._m.logits()
        return loss

    @_locked
    def token_losses(self) -> np.ndarray:
        """(B, T) per-token losses of the last forward with targets (0 at ignored positions)."""
        return self._m.token_losses()

    @_locked
    def backward(self, grad_scale: float = 1.0) -> None:
        """Accumulate d(grad_scale * loss)/d(params) into self.grads."""
        self._m.backward(_grad_scale(grad_scale))
        self._has_grads = True

    @_locked
    def forward_backward(self, idx, targets, grad_scale: float = 1.0) -> None:
        """One training micro-step: forward(idx, targets) then backward(grad_scale), without waiting for the
        GPU (no loss is read back). grad_scale * loss is added to a sum that take_loss() returns. With
        cuda_graphs on, the second call for a shape records the step's kernels into a CUDA graph and later
        calls replay it. The gradients are complete once grad_norm(), step() or take_loss() returns."""
        self._m.forward_backward(as_tokens(idx, "idx"), as_tokens(targets, "targets"), _grad_scale(grad_scale))
        self._has_grads = True

    @_locked
    def take_loss(self) -> float:
        """The sum of grad_scale * loss over forward_backward calls since the last take_loss (then reset)."""
        return self._m.take_loss()

    @property
    def cuda_graphs(self) -> bool:
        """Capture forward_backward, the optimizer step (step()) and the KV-cache decode step (generate's
        per-token step, one graph per batch size; not for rotary models, whose decode runs directly) in CUDA graphs
        and replay them (device='cuda' only; turns itself off, with a message, if a step cannot be captured)."""
        return self._m.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        if on and self.device == "cpu":
            raise ValueError("cuda_graphs needs device='cuda': the CPU backend runs each op as it is called")
        self._m.cuda_graphs = bool(on)

    @_locked
    def zero_grad(self) -> None:
        self._m.zero_grad()
        self._has_grads = False

    @_locked
    def grad_norm(self) -> float:
        return self._m.grad_norm()

    @_locked
    def step(self, lr: float, weight_decay: float = TrainConfig.weight_decay, beta1: float = TrainConfig.beta1,
             beta2: float = TrainConfig.beta2, eps: float = TrainConfig.eps,
             grad_clip: float = TrainConfig.grad_clip, optimizer: str = "adamw",
             muon_lr: float = TrainConfig.muon_lr, muon_momentum: float = TrainConfig.muon_momentum,
             muon_weight_decay: float = TrainConfig.muon_weight_decay,
             muon_ns_steps: int = TrainConfig.muon_ns_steps, *, muon_matrices: tuple[int, int] | None = None,
             muon_ns_dtype: str = TrainConfig.muon_ns_dtype,
             embedding_lr: float | None = None, head_lr: float | None = None) -> float:
        """Clip the global gradient norm to grad_clip (0 disables), take one AdamW step, return the
        pre-clip norm.

        optimizer="muon": Muon (csrc/model/optimizer.h) for the hidden matrices (muon_params(): attention q, k, v
        and projection, the MLP's two matrices) with its own muon_lr, muon_momentum (this step's, after any
        warm-up: schedule.muon_momentum_at) and muon_weight_decay, muon_ns_steps Newton-Schulz iterations (their
        products in muon_ns_dtype: "float32", the model's type, or "bfloat16", inputs rounded to bf16); AdamW
        (lr, weight_decay, betas, eps) for the rest, with embedding_lr for the embeddings (wte, wpe; a tied head
        is wte) and head_lr for an untied lm_head in place of lr where given (the per-group LRs of modded-nanogpt
        and nanochat; csrc/model/config.h param_lr_group). The momentum lives in opt_state()'s first moment (m) of those
        tensors, so checkpoints carry it. Afterwards the Muon tensors' gradients hold their orthogonalised update.
        muon_matrices=(lo, hi): only matrices [lo, hi) of muon_matrix_list() are orthogonalised and applied (data
        parallel: this rank's share; the caller all-gathers the rest). A non-finite norm raises FloatingPointError and leaves the weights untouched;
        so does a hyperparameter out of range (ValueError naming it, see check_step_args).

        With loss scaling, the norm is of the unscaled gradients, and a non-finite one is an overflow: the step
        is skipped as GradScaler skips optimizer.step() (weights and AdamW moments untouched), the scale halves,
        skipped_steps counts it, and the non-finite norm is returned instead of raised. Step counters, as with
        GradScaler: step_count counts the updates applied, and AdamW's bias correction (and the bf16 rounding
        seed) use it, so a skipped step does not advance them; the learning rate is the caller's, and a loop
        that takes it from its own step (train.py) moves on past a skipped step."""
        check_step_args(lr, weight_decay, beta1, beta2, eps, grad_clip)
        if not self._has_grads and self._m.grad_norm() == 0.0:
            raise NoGradientsError("step() before backward(): there are no gradients to apply (weight decay alone "
                                   "would shrink the weights); call forward(x, y) and backward() first")
        # norm, clip scale, update and the loss scaler's step all in the backend (one graph with cuda_graphs): no
        # wait for the GPU until the norm is read back at the end
        clip = grad_clip if grad_clip and grad_clip > 0 else 0.0
        check_group_lrs(optimizer, embedding_lr, head_lr)
        if optimizer == "muon":
            check_muon_args(muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps)
            if muon_ns_dtype not in ("float32", "bfloat16"):
                raise ValueError(f"muon_ns_dtype must be 'float32' or 'bfloat16', got {muon_ns_dtype!r}")
            lo, hi = muon_matrices or (0, -1)
            norm = self._m.muon_optimizer_step(
                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=self.step_count + 1,
                grad_clip=clip, muon_lr=muon_lr, muon_momentum=muon_momentum, muon_weight_decay=muon_weight_decay,
                ns_steps=muon_ns_steps, mat_lo=lo, mat_hi=hi, embedding_lr=embedding_lr, head_lr=head_lr,
                ns_dtype=muon_ns_dtype)
        elif optimizer == "adamw":
            norm = self._m.optimizer_step(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                          step=self.step_count + 1, grad_clip=clip)
        else:
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
        if not math.isfinite(norm):  # the backend wrote nothing
            if self.loss_scaling:
                return norm
            raise FloatingPointError(f"gradient norm is {norm} at step {self.step_count + 1}; weights not updated")
        self.step_count += 1  # only once the update was accepted
        return norm

    # ------------------------------------------------------------------ Muon's parameter groups
    def muon_matrix_list(self) -> list[tuple[int, int, int, str, int]]:
        """The matrices Muon orthogonalises, in flat-offset order: (offset, rows, cols, tensor, layer); each layer's
        qkvw slice is three of them (q, k, v)."""
        return list(self._m.muon_matrices)

    @staticmethod
    def muon_params() -> tuple[str, ...]:
        """The tensors Muon updates (with optimizer="muon", the core's policy: csrc/model/config.h
        param_uses_muon); every other tensor is AdamW's."""
        return tuple(_C.muon_param_names())



def load_model(path, training: bool = False, device: str = "cpu", padded_vocab_size: int | None = None,
               inference_weights: str = "fp32") -> GPT2:
    """A GPT2 from any model file, checkpoint or Hugging Face source (GPT2.from_pretrained). training=False (the
    default) gives an inference-only model: no gradients, AdamW moments or backward activations are allocated
    (forward, generate and evaluation work; backward and step raise); training=True a model that trains on.
    inference_weights: "fp32", "bf16" / "fp16" (16-bit) or "int8" (8-bit) decode weights (see GPT2.inference_weights)."""
    model = GPT2.from_pretrained(path, device=device, padded_vocab_size=padded_vocab_size, training=training)
    if inference_weights != "fp32":
        model.inference_weights = inference_weights
    return model
