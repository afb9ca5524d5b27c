"""GPT2's flat buffers for data parallel training: every parameter and gradient as one vector, the sum of squares
and AdamW over one rank's range (ZeRO-1/2), the overlapped gradient all-reduce. A mixin of GPT2 that
gpt2core.distributed drives."""
from __future__ import annotations

import numpy as np

from .. import _C
from .threads import locked as _locked


class FlatBuffers:
    """Views and range operations over the core's flat parameter / gradient buffers."""

    def flat_params(self) -> np.ndarray:
        """All parameters as one vector (a view, param_names() order): what collectives send."""
        return self._m.flat_params()

    def flat_grads(self) -> np.ndarray:
        """All gradients as one vector (a view, the layout of flat_params)."""
        return self._m.flat_grads()

    @_locked
    def grad_sum_squares(self, lo: int, hi: int) -> float:
        """sum(g**2) over flat_grads()[lo:hi], accumulated in float64."""
        if isinstance(self._m, _C.ModelF64):  # the core's routine serves float32 master gradients
            g, total = self._m.flat_grads()[lo:hi], 0.0
            for i in range(0, g.size, 1 << 20):  # chunk by chunk: no full-size temporary
                c = g[i:i + (1 << 20)]
                total += float(np.dot(c, c))
            return total
        return _C.dist.grad_sum_squares(self._m, lo, hi)

    def alloc_optimizer_state(self, n: int) -> np.ndarray:
        """n zeros in the backend's memory (device memory on GPUs), in the optimizer state's dtype."""
        if isinstance(self._m, _C.ModelF64):
            return np.zeros(n, dtype=np.float64)
        return _C.dist.alloc_state(self._m, n)

    @_locked
    def adamw_range(self, lo: int, hi: int, m: np.ndarray, v: np.ndarray, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, step: int, grad_clip: float, sum_squares: float) -> None:
        """AdamW on parameters [lo, hi) of flat_params() only, with moments m, v of length hi - lo (ZeRO-1's
        shard): weight decay on 2-D weights, bias correction for `step`, the gradients clipped as step() clips
        them to grad_clip (0: none) by the global norm sqrt(sum_squares), the sum over ALL gradients (every
        rank's shard). Nothing is written when that norm is not finite."""
        self._m.adamw_update_range(lo, hi, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                   step=step, grad_clip=grad_clip, sum_squares=sum_squares)

    def grad_allreducer(self, comm):
        """A _C.dist.GradAllreducer over comm for this model: its backward(scale) is this model's backward,
        with each group of final gradients averaged over the ranks while the rest of backward runs
        (float32, bf16 and fp16 models)."""
        return _C.dist.GradAllreducer(comm, self._m)
