"""Loop-style experts captured as grouped matmuls.

Some Hugging Face MoE layers run their experts in a Python loop over the experts a batch hits
(DBRX: ``nonzero`` over the expert mask, then one matmul per expert; JetMoE: the rows per expert
as a Python list, ``expert_size.tolist()``, in its feed-forward and its attention experts), which
torch.export cannot capture: how many experts run, or how many rows each takes, is data.
transformers offers no other implementation of them. For the capture alone
(``traceable_experts``), such a layer's forward (JetMoE's attention experts: ``map`` and
``reduce``) is replaced by the same
computation written the way Mixtral's default experts are: the token rows sorted by expert, the
rows per expert counted (a fixed ``E``-long histogram, their running sum the offsets), and one
grouped matmul per weight over all experts at once (transformers' own ``_grouped_mm``, so the graph
holds the ops core/experts.py finds an MoE layer by, and expert parallelism splits it as any
other). The weights are the layer's own parameters, viewed per expert; the sum over a token's
experts, weighted by the router, is the loop's. Outside the capture the layer keeps its forward: a
plan that runs the model eagerly runs the loop, one that runs the graph runs the grouped matmuls,
and the two agree to rounding (tests/integration/test_expert_parallel.py).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' grouped matmul (torch's kernel where it has a usable one, else its fallback op),
    called on ``rows`` as they are: its dispatcher's cast of the rows to the weight's dtype would put a
    node of its own before each matmul, where the layer's matmuls should read the one rows node."""
    from transformers.integrations import moe

    if moe._can_use_grouped_mm(rows, weight, offs):
        kernel = getattr(torch.nn.functional, "grouped_mm", None)
        return kernel(rows, weight, offs=offs) if kernel is not None else torch._grouped_mm(rows, weight, offs=offs)
    return torch.ops.transformers.grouped_mm_fallback(rows, weight, offs=offs)


def _sorted_rows(x: torch.Tensor, top_k_index: torch.Tensor, experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the token rows sorted by expert, the permutation (row i is pair perm[i] of token perm[i] // k),
    the offsets: the running sum of the rows per expert)."""
    k = top_k_index.shape[-1]
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    return x[perm // k], perm, _offsets(ids, experts)


def _offsets(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The running sum of the rows per expert (``ids``: each row's expert), as a grouped matmul takes it."""
    counts = torch.histc(ids.float(), bins=experts, min=0, max=experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def _dbrx_experts(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """DbrxExperts.forward as grouped matmuls (module docstring): w1, v1 and w2 are (E x F, H)."""
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    rows, perm, offs = _sorted_rows(x.to(self.mlp.w1.dtype), top_k_index, self.num_experts)
    per_expert = (-1, self.ffn_hidden_size, self.hidden_size)
    mlp = self.mlp
    gate = _grouped_mm(rows, mlp.w1.view(per_expert).transpose(-2, -1), offs)
    up = _grouped_mm(rows, mlp.v1.view(per_expert).transpose(-2, -1), offs)
    out = _grouped_mm(mlp.activation_fn(gate) * up, mlp.w2.view(per_expert), offs)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)
    k = top_k_index.shape[-1]
    return torch.zeros_like(x).index_add_(0, perm // k, out).view(batch, -1, self.hidden_size)


def _jetmoe_route(router: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """JetMoeTopKGating's routing without its ``expert_size.tolist()``: (logits, each token's top-k
    experts, their softmaxed gates)."""
    logits = router.layer(x).float()
    top_logits, top_index = logits.topk(router.top_k, dim=1)
    return logits, top_index, torch.softmax(top_logits, dim=1).type_as(x)


def _jetmoe_moe(self: Any, layer_input: torch.Tensor) -> torch.Tensor:
    """JetMoeMoE.forward (its feed-forward experts) as grouped matmuls over its (E, out, in) weights."""
    bsz, length, emb = layer_input.size()
    x = layer_input.reshape(-1, emb)
    _, top_index, gates = _jetmoe_route(self.router, x)
    rows, perm, offs = _sorted_rows(x, top_index, self.router.num_experts)
    gate, up = _grouped_mm(rows, self.input_linear.weight.transpose(-2, -1), offs).chunk(2, dim=-1)
    out = _grouped_mm(self.activation(gate) * up, self.output_linear.weight.transpose(-2, -1), offs)
    return _jetmoe_merge(self, out, gates, perm, top_index.shape[-1], bsz, length)


def _jetmoe_merge(self: Any, out: torch.Tensor, gates: torch.Tensor, perm: torch.Tensor, k: int, bsz: int,
                  length: int) -> torch.Tensor:
    """The expert rows ``out`` (in expert order, ``perm``) weighted by their gates and summed back to
    their tokens, plus the layer's bias: how JetMoE's feed-forward and attention experts end. The sum
    is made in ``out``'s dtype as run (autocast's, not the capture's)."""
    out = out * gates.reshape(-1)[perm].unsqueeze(-1)
    y = out.new_zeros((bsz * length, self.input_size)).index_add(0, perm // k, out)
    return y.view(bsz, length, self.input_size) + self.bias


def _jetmoe_map(self: Any, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """JetMoeMoA.map (its attention experts' query projections) as one grouped matmul; the routing it
    returns for ``reduce`` holds tensors, not the rows per expert as a list."""
    bsz, length, emb = layer_input.size()
    x = layer_input.reshape(-1, emb)
    logits, top_index, gates = _jetmoe_route(self.router, x)
    rows, perm, offs = _sorted_rows(x, top_index, self.num_experts)
    out = _grouped_mm(rows, self.input_linear.weight.transpose(-2, -1), offs)
    q = out.new_zeros((bsz * length * self.top_k, self.hidden_size))
    return q.index_add(0, perm, out).view(bsz, length, self.top_k, -1), logits, (perm, top_index, gates)


def _jetmoe_reduce(self: Any, layer_input: torch.Tensor, topo: tuple) -> torch.Tensor:
    """JetMoeMoA.reduce (the attention experts' output projections) as one grouped matmul. Its offsets
    are counted again: ``map``'s and ``reduce``'s matmuls are two expert layers (core/experts.py finds a
    layer by its offsets), attention between them running on each token's own rank."""
    perm, top_index, gates = topo
    bsz, length, k, hidden = layer_input.size()
    offs = _offsets(top_index.reshape(-1), self.num_experts)
    out = _grouped_mm(layer_input.reshape(-1, hidden)[perm], self.output_linear.weight.transpose(-2, -1), offs)
    return _jetmoe_merge(self, out, gates, perm, k, bsz, length)


# class name -> {method: the grouped-matmul version that replaces its loop during the capture}
LOOP_EXPERTS: dict[str, dict[str, Callable[..., Any]]] = {
    "DbrxExperts": {"forward": _dbrx_experts},
    "JetMoeMoE": {"forward": _jetmoe_moe},
    "JetMoeMoA": {"map": _jetmoe_map, "reduce": _jetmoe_reduce},
}


@contextlib.contextmanager
def traceable_experts(module: torch.nn.Module) -> Iterator[list[str]]:
    """Inside the block, every loop-style experts layer of ``module`` (``LOOP_EXPERTS``) runs as
    grouped matmuls; the names of those replaced are yielded. Their forwards are restored after."""
    replaced = [(name, m) for name, m in module.named_modules() if type(m).__name__ in LOOP_EXPERTS]
    for _, m in replaced:
        for method, fn in LOOP_EXPERTS[type(m).__name__].items():
            setattr(m, method, types.MethodType(fn, m))
    try:
        yield [name for name, _ in replaced]
    finally:
        for _, m in replaced:
            for method in LOOP_EXPERTS[type(m).__name__]:
                with contextlib.suppress(AttributeError):
                    delattr(m, method)
