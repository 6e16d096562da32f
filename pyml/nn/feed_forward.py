"""Feed-forward blocks: the GELU MLP (GPT-2) and gated units (SwiGLU for Llama, GeGLU for Gemma)."""

from __future__ import annotations

import numpy as np

from pyml.core import ops, perf
from pyml.nn.linear import Linear

_perf = perf.get("pyml.nn.feed_forward")
MLP_SPAN = ("feed_forward", "{} mlp")  # x's shape
GATED_SPAN = ("feed_forward", "{} {}")  # x's shape, act


class MLP:
    """down(act(up(x))), act = GELU (tanh form for GPT-2's gelu_new)."""

    def __init__(self, up: Linear, down: Linear, act: str = "gelu_tanh", name: str = ""):
        self.up, self.down, self.name = up, down, name
        self.act = {"gelu_tanh": ops.gelu_tanh, "gelu": ops.gelu_erf, "silu": ops.silu}[act]

    def linears(self) -> list:
        return [self.up, self.down]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with _perf.trace(*MLP_SPAN, x.shape, module=self.name, op="feed_forward"):
            return self.down(self.act(self.up(x)))


class GatedMLP:
    """down(act(gate(x)) * up(x)); gate and up fused into one matmul when their storage allows."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act: str, name: str = ""):
        self.down, self.act, self.name = down, act, name
        self.gate_up = Linear.fuse([gate, up], name=f"{name}.gate_up_proj")
        self.gate, self.up = (None, None) if self.gate_up else (gate, up)
        self.fused = self.gate_up is not None

    def linears(self) -> list:
        return ([self.gate_up] if self.fused else [self.gate, self.up]) + [self.down]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with _perf.trace(*GATED_SPAN, x.shape, self.act, module=self.name, op="feed_forward"):
            if self.gate_up is not None:
                h = ops.gated(self.gate_up(x), self.act)
            else:
                h = ops.gated(np.concatenate([self.gate(x), self.up(x)], axis=1), self.act)
            return self.down(h)
