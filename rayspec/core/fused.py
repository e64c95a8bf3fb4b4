"""A predicting stage's update in one pass over memory: the optimizer's step and SpecTrain's prediction of the
weights the next action runs at, one compiled kernel per parameter (``optim.compile``).

[Note: one pass] SpecTrain steps after every micro-batch and then predicts: torch's fused step reads the gradient,
the state and the weights and writes the state and the weights; the prediction ``A * W + B * D``
(``rayspec.core.predict``) reads the new weights and the direction again and writes the predicted copy, and
Adam's direction ``D`` is a third pass of its own (five calls). Each element needs to be read once and written
once: gradient, state and weights in; state, weights and the predicted copy out. ``torch.compile`` of the step
and the prediction together gives that one loop on CPU and on CUDA (Inductor fuses the element-wise graph).
Measured on a 5.25M-element stage, one CPU thread (``python -m benchmarks.stage_cost --levers``): SGD's step and
prediction as torch's fused step plus one add move 8 passes' bytes where 6 suffice; AdamW's as the fused step,
the direction and the prediction 23 where 8 suffice; compiled, both run near the bandwidth of ``copy_``.

The kernels compute torch's update (``torch.optim.SGD``'s and ``Adam``'s/``AdamW``'s formulas, their state in
torch's ``state_dict`` format) to rounding: Inductor may contract multiply-adds where torch's kernels do not, so
a run with ``optim.compile`` is not bit-equal to one without (each is deterministic). They run only where a
prediction follows the update and the optimizer's state exists (from the second update on), and never for the
methods that do not predict, which keep torch's own step. A kernel that cannot be compiled here (no C++
compiler) is reported once and the update goes back to torch's step and a separate prediction.

Levers measured and not kept: one flat buffer per stage for weights, gradients and state (parameters as views)
makes the compiled pass one call instead of one per parameter, 0.3-0.7 ms less per update on the benchmark's
stage of 6 tensors (a compiled call's guards cost about 60 us; ``benchmarks.stage_cost``'s levers), but needs the
gradients flat too: autograd writes fresh gradient tensors, and copying them in (or accumulating into a zeroed
flat buffer) adds a pass, a sixth of the minimum, which takes back about what the single call saves. One compiled
call over the list of parameters would compile again for every stage of another parameter count. Chunking
torch's fused step and the prediction so that a chunk stays in cache loses more to Python per call than it
saves (0.57-0.95 of the separate calls' speed at chunks of 16K-256K elements, one thread).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["adam_step", "sgd_step"]

log = logging.getLogger(__name__)

_compiled: dict[str, Callable[..., None] | None] = {}  # per kernel; None: it could not be compiled here


def _sgd_kernel(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, p: torch.Tensor, k: torch.Tensor,
                decay: bool, nesterov: bool) -> None:
    """torch's SGD step (the buffer exists) and ``p = a * W + b * buffer``; ``k``: lr, mu, 1 - dampening, wd, a, b."""
    lr, mu, keep, wd, a, b = k[0], k[1], k[2], k[3], k[4], k[5]
    if decay:
        g = g + wd * w
    buf = m * mu + keep * g
    w_new = w - lr * (g + mu * buf if nesterov else buf)
    m.copy_(buf)
    w.copy_(w_new)
    p.copy_(a * w_new + b * buf)


def _adam_kernel(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                 k: torch.Tensor, decay: bool, decoupled: bool) -> None:
    """torch's Adam/AdamW step and ``p = a * W + b * D`` with ``D`` at the next step's bias corrections; ``k``:
    lr, beta1, beta2, wd, lr / bc1, 1 / sqrt(bc2), eps, a, b / bc1', 1 / sqrt(bc2') (``'``: the next step's;
    multiplying by the reciprocals, one rounding from torch's division, keeps the loop memory-bound)."""
    lr, b1, b2, wd, step_size, inv_root2, eps, a, b, inv_root2_next = (k[i] for i in range(10))
    kept = w
    if decay and decoupled:
        kept = w * (1 - lr * wd)
    elif decay:
        g = g + wd * w
    m_new = m + (1 - b1) * (g - m)  # torch's lerp
    v_new = v * b2 + (1 - b2) * g * g
    root = torch.sqrt(v_new)
    w_new = kept - step_size * m_new / (root * inv_root2 + eps)
    m.copy_(m_new)
    v.copy_(v_new)
    w.copy_(w_new)
    p.copy_(a * w_new + b * (m_new / (root * inv_root2_next + eps)))


_KERNELS: dict[str, Callable[..., None]] = {"sgd": _sgd_kernel, "adam": _adam_kernel}


def _kernel(name: str) -> Callable[..., None] | None:
    """``name``'s kernel compiled once per process (shapes symbolic: one compile serves every parameter)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(_KERNELS[name], dynamic=True, fullgraph=True)
    return _compiled[name]


def _run(name: str, tensors: Sequence[Sequence[torch.Tensor]], k: torch.Tensor, **flags: bool) -> bool:
    """Run ``name``'s kernel on each parameter's flattened tensors; False where it cannot be compiled here (nothing
    was written then: compiling comes before the first write; a failure after a parameter was updated raises)."""
    fn = _kernel(name)
    if fn is None or not all(t.is_contiguous() for ts in tensors for t in ts):
        return False
    done = 0
    try:
        for ts in tensors:
            fn(*(t.view(-1) for t in ts), k, **flags)
            done += 1
    except Exception as e:  # the compiler's own errors (no C++ compiler, an unsupported device) vary
        if done:  # some parameters are updated already: torch's step cannot take over
            raise
        log.warning("optim.compile: the %s update could not be compiled here (%s); using torch's step and a "
                    "separate prediction", name, str(e).splitlines()[0] if str(e) else type(e).__name__)
        _compiled[name] = None
        return False
    return True


def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
             out: Sequence[torch.Tensor], lr: float, spec: Any, a: float, b: float) -> bool:
    """torch's SGD step with momentum on ``params`` (their buffers exist) and ``out = a * W + b * buffer`` in one
    pass; ``spec``: the ``OptimSpec``. Returns whether it ran (else nothing was written)."""
    dev = params[0].device
    k = torch.tensor([lr, spec.momentum, 1.0 - spec.dampening, spec.weight_decay, a, b], dtype=torch.float64,
                     device=dev)
    return _run("sgd", list(zip(params, grads, buffers, out)), k, decay=spec.weight_decay != 0,
                nesterov=spec.nesterov)


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: Sequence[dict[str, Any]],
              out: Sequence[torch.Tensor], lr: float, spec: Any, decoupled: bool, a: float, b: float) -> bool:
    """torch's Adam (AdamW: ``decoupled``) step on ``params`` (their states exist, all at one step count) and
    ``out = a * W + b * D`` of the new state, in one pass; the step counts move on. Returns whether it ran."""
    b1, b2 = spec.betas
    t = float(states[0]["step"]) + 1  # this step's bias corrections, then the next one's for D
    bc1, bc2, bc1_next, bc2_next = 1 - b1**t, 1 - b2**t, 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
    k = torch.tensor([lr, b1, b2, spec.weight_decay, lr / bc1, 1 / math.sqrt(bc2), spec.eps, a, b / bc1_next,
                      1 / math.sqrt(bc2_next)], dtype=torch.float64, device=params[0].device)
    tensors = [(w, g, st["exp_avg"], st["exp_avg_sq"], o) for w, g, st, o in zip(params, grads, states, out)]
    if not _run("adam", tensors, k, decay=spec.weight_decay != 0, decoupled=decoupled):
        return False
    for st in states:
        st["step"] += 1
    return True
