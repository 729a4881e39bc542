"""Attention over a sequence split across a context-parallel group (core/mesh.py ``Mesh.cp``).

Each rank of a cp group holds two of the ``2 cp`` chunks of every sequence (``sequence_chunks``:
chunk ``r`` and its mirror, Megatron-LM's causal load balance) and runs every op but attention on
its own tokens. An attention core meets the rest of its sequence one of two ways:

- **ring** (``RingAttention``; Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
  the rank's keys and values go round the group, ``cp - 1`` exchanges with the ring's neighbours;
  a block is its chunks against the held keys' chunks, each pair run by the fused attention kernel
  (causal on a chunk's own diagonal, full against an earlier chunk, skipped against a later one)
  and merged into the output by the online softmax (the partial outputs weighed by their
  logsumexps); the next block's exchange is in flight while the current block computes. Backward goes round
  again, and each block's key and value gradients are summed along the ring as a reduce-scatter
  does: from the owner's next rank, ``cp - 1`` hops home, where the owner's own share waits.
- **all-to-all** (``ulysses``; Jacobs et al. 2023, "DeepSpeed Ulysses"): q, k and v go from
  sequence slices to head groups by one all-to-all each, attention runs on whole sequences of
  ``heads / cp`` heads (put in position order, so a causal mask is the plain one), and the output
  comes back by a fourth; backward is the same four the other way.

Both compute in fp32 where they merge blocks (the ring) and cast back to the inputs' dtype. Every
call is counted on the "cp" axis (runtime/collectives.py), so a step's calls can be checked against
the plan's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from partita.core.axes.context import RING_GRAD_DTYPE
from partita.core.mesh import MeshAxis, sequence_chunks, sequence_positions
from partita.core.precision import torch_dtype
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.collectives import all_gather_flat as _all_gather

CP = MeshAxis.CP.value
_GRAD = torch_dtype(RING_GRAD_DTYPE)  # the gradient sums the ring passes on (core/axes/context.py)


class ContextGroup:
    """This rank's context-parallel group: its process group, size and place, the global sequence
    length, and the positions each rank of the group holds."""

    def __init__(self, group: dist.ProcessGroup, counter: CollectiveCounter, seq_len: int,
                 device: torch.device) -> None:
        self.group, self.counter, self.seq_len, self.device = group, counter, seq_len, device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.peers = [dist.get_global_rank(group, i) for i in range(self.size)]
        self._positions = [torch.tensor(sequence_positions(seq_len, self.size, r), dtype=torch.int64, device=device)
                           for r in range(self.size)]
        self.order = torch.cat(self._positions)  # the position of each row of the group's ranks' rows, in rank order
        self._pad: tuple[Any, torch.Tensor] | None = None  # the last padding mask gathered (``key_mask``)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """The positions (int64) rank ``rank`` of the group holds (this rank's by default)."""
        return self._positions[self.rank if rank is None else rank]

    def _exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> list[Any]:
        """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous, begun."""
        nxt, prev = self.peers[(self.rank + 1) % self.size], self.peers[(self.rank - 1) % self.size]
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group) for t in recv]
        # one batched launch: one call of their bytes, as the plan lists it (passes/context.py)
        self.counter.record("send_recv", CP, sum(t.numel() * t.element_size() for t in send))
        return dist.batch_isend_irecv(ops)

    def pass_on(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """``tensors`` sent on round the ring, and the previous rank's in their place (begun: wait on
        the works before reading them)."""
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        return received, self._exchange(tensors, received)

    def wait(self, works: list[Any]) -> None:
        with self.counter.blocking("send_recv", CP):
            for w in works:
                w.wait()

    def key_mask(self, pad: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of a padding mask ([cp, b, s/cp], bool: a real token), gathered once per
        micro-batch (the layers pass the same input tensor)."""
        key = (pad.data_ptr(), pad._version, tuple(pad.shape))
        if self._pad is None or self._pad[0] != key:
            mine = (pad != 0).to(torch.uint8).contiguous()
            every = mine.new_empty((self.size * mine.shape[0], *mine.shape[1:]))
            self.counter.record("all_gather", CP, mine.numel())
            with self.counter.blocking("all_gather", CP):
                _all_gather(every, mine, group=self.group)
            self._pad = (key, every.view(self.size, *mine.shape).bool())
        return self._pad[1]

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s dim-0 slice j to rank j of the group, and each rank's slice for this one in its place."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.counter.record("all_to_all", CP, x.numel() * x.element_size())
        with self.counter.blocking("all_to_all", CP):
            dist.all_to_all_single(out, x, group=self.group)
        return out


# -- ring ------------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values of fewer heads (grouped-query attention) repeated to ``heads``."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _ungrouped(g: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient over ``g.shape[1]`` repeated heads summed back to the ``heads`` they repeat."""
    if g.shape[1] == heads:
        return g
    b, h, s, d = g.shape
    return g.view(b, heads, h // heads, s, d).sum(2)


# A block of attention: (q, k, v, causal, scale, allowed) -> (out, logsumexp of each query's scores;
# -inf for a query that may see no key of the block), and its backward given the whole row's out and
# logsumexp -> (dq, dk, dv) of this block. ``allowed`` (bool, [b, 1, q, k]) is a padding mask with
# the causal one folded in (``causal`` then False). On the CPU, PyTorch's fused flash kernel;
# elsewhere the same arithmetic written out (fp32).


def _masked_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
                   allowed: torch.Tensor | None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A logsumexp with -inf (a query that sees no key) read as 0: its probabilities all 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _block_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = _masked_scores(q, k, causal, scale, allowed)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - _finite(lse)[..., None]) @ v.float()).to(q.dtype), lse


def _block_math_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float,
                         allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    qf, kf, dof = q.float(), k.float(), do.float()
    p = torch.exp(_masked_scores(q, k, causal, scale, allowed) - lse[..., None])
    ds = p * (dof @ v.float().transpose(-1, -2) - (dof * out.float()).sum(-1, keepdim=True))
    return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, p.transpose(-1, -2) @ dof


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the fused kernel takes it: 0 where allowed, -inf elsewhere, in the queries' dtype."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type != "cpu":
        return _block_math(q, k, v, causal, scale, allowed)
    if allowed is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive(allowed, q.dtype), scale=scale)
    # the kernel gives a query that sees no key an output of 0 and a logsumexp of 0: -inf here, so
    # that merging it weighs it 0
    return out, torch.where(allowed.any(-1).expand(lse.shape), lse, torch.full_like(lse, float("-inf")))


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    if q.device.type != "cpu":
        return _block_math_backward(do, q, k, v, out, lse, causal, scale, allowed)
    mask = None if allowed is None else _additive(allowed, q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal and mask is None, attn_mask=mask, scale=scale)


def _allowed(valid: torch.Tensor | None, src: int, j: int, diag: bool, queries: int) -> torch.Tensor | None:
    """The bool mask of a chunk pair under a padding mask: rank ``src``'s key chunk ``j`` where its
    tokens are real (``valid``: the group's key masks, [cp, b, s/cp]), the causal diagonal folded in."""
    if valid is None:
        return None
    keys = valid[src].chunk(2, dim=1)[j]  # [b, keys]
    allowed = keys[:, None, None, :].expand(keys.shape[0], 1, queries, keys.shape[1])
    if diag:
        allowed = allowed & torch.ones(queries, keys.shape[1], dtype=torch.bool, device=keys.device).tril()
    return allowed


def _pairs(g: ContextGroup, src: int, causal: bool) -> list[tuple[int, int, bool]]:
    """Which of this rank's two query chunks meet which of rank ``src``'s two key chunks, and whether
    causally (the same chunk: its diagonal); under a causal mask a later key chunk is not met."""
    mine, theirs = sequence_chunks(g.size, g.rank), sequence_chunks(g.size, src)
    out = []
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            if not causal or kc < qc:
                out.append((i, j, False))
            elif kc == qc:
                out.append((i, j, True))
    return out


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's rows as its two chunks (sequence_chunks' order)."""
    return x.chunk(2, dim=2)


def _blocks(g: ContextGroup, k: torch.Tensor, v: torch.Tensor, heads: int) -> Iterator[tuple[Any, ...]]:
    """The ring's blocks in turn, forward and backward alike: (the rank whose block it is, the block
    as sent [k, v], its two chunks of keys and of values repeated to ``heads``), the next block on its
    way while the caller computes on this one."""
    block = [k, v]
    for step in range(g.size):
        works: list[Any] = []
        if step < g.size - 1:
            nxt, works = g.pass_on(block)
        yield (g.rank - step) % g.size, block, _halves(_grouped(block[0], heads)), _halves(_grouped(block[1], heads))
        if works:
            g.wait(works)
            block = nxt


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: ContextGroup, causal: bool,
                scale: float, valid: torch.Tensor | None = None) -> torch.Tensor:
        heads = q.shape[1]
        qs = [c.contiguous() for c in _halves(q)]
        outs: list[torch.Tensor | None] = [None, None]  # per query chunk, merged so far (fp32)
        lses: list[torch.Tensor | None] = [None, None]
        with torch.autocast(q.device.type, enabled=False):
            for src, _, ks, vs in _blocks(g, k, v, heads):
                for i, j, diag in _pairs(g, src, causal):
                    allowed = _allowed(valid, src, j, diag, qs[i].shape[2])
                    o, lse = _block(qs[i], ks[j].contiguous(), vs[j].contiguous(), diag and allowed is None, scale,
                                    allowed)
                    if outs[i] is None:
                        outs[i], lses[i] = o.float(), lse
                    else:  # the online softmax: two partial outputs merged by their logsumexps
                        new = torch.logaddexp(lses[i], lse)
                        outs[i] = (outs[i] * torch.exp(lses[i] - _finite(new))[..., None]
                                   + o.float() * torch.exp(lse - _finite(new))[..., None])
                        lses[i] = new
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = _finite(torch.cat(lses, dim=2))  # (a query that sees no key: output 0, as one process's)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.g, ctx.causal, ctx.scale, ctx.valid = g, causal, scale, valid
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        g, causal, scale, valid = ctx.g, ctx.causal, ctx.scale, ctx.valid
        heads = q.shape[1]
        qs, outs, lses, dos = ([c.contiguous() for c in _halves(t)] for t in (q, out, lse, grad.to(q.dtype)))
        dq: list[Any] = [None, None]
        travelling: list[torch.Tensor] = []  # the held block's gradient sums, from the ranks it passed
        with torch.autocast(q.device.type, enabled=False):
            # the keys and values go round again; their gradients' sums follow each block
            for step, (src, block, ks, vs) in enumerate(_blocks(g, k, v, heads)):
                dks: list[Any] = [None, None]
                dvs: list[Any] = [None, None]
                for i, j, diag in _pairs(g, src, causal):
                    allowed = _allowed(valid, src, j, diag, qs[i].shape[2])
                    a, b, c = _block_backward(dos[i], qs[i], ks[j].contiguous(), vs[j].contiguous(), outs[i],
                                              lses[i], diag and allowed is None, scale, allowed)
                    dq[i] = a.float() if dq[i] is None else dq[i] + a
                    dks[j] = b.float() if dks[j] is None else dks[j] + b
                    dvs[j] = c.float() if dvs[j] is None else dvs[j] + c
                dk_here = torch.cat([x if x is not None else torch.zeros(y.shape, device=y.device)
                                     for x, y in zip(dks, ks)], dim=2).to(_GRAD)
                dv_here = torch.cat([x if x is not None else torch.zeros(y.shape, device=y.device)
                                     for x, y in zip(dvs, vs)], dim=2).to(_GRAD)
                dk_here = _ungrouped(dk_here, block[0].shape[1])
                dv_here = _ungrouped(dv_here, block[1].shape[1])
                if step == 0:  # this rank's own block: its share stays here for the sums to come home to
                    dk, dv = dk_here, dv_here
                else:  # a peer's: added to the sums that travel with it, passed on towards its owner
                    sums = [a + b for a, b in zip(travelling, (dk_here, dv_here))] if travelling else [dk_here, dv_here]
                    travelling, sent = g.pass_on(sums)  # after the last block they reach its owner
                    g.wait(sent)
            if travelling:  # the other ranks' sums for this rank's own block, home
                dk, dv = dk + travelling[0], dv + travelling[1]
        dq = [x if x is not None else torch.zeros(c.shape, device=q.device) for x, c in zip(dq, qs)]
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# -- all-to-all (Ulysses) --------------------------------------------------------------------------


class _Swap(torch.autograd.Function):
    """``to_heads``: [b, h, s/cp, d] sequence slices -> [b, h/cp, s, d] head groups over the whole
    sequence, in the group's rank order of rows (``ContextGroup.order`` gives each row's position);
    else the way back. Backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: ContextGroup, to_heads: bool) -> torch.Tensor:
        ctx.g, ctx.to_heads = g, to_heads
        return _to_heads(x, g) if to_heads else _to_sequence(x, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (_to_sequence(grad, ctx.g) if ctx.to_heads else _to_heads(grad, ctx.g)), None, None


def _to_heads(x: torch.Tensor, g: ContextGroup) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, g.size, h // g.size, s, d).transpose(0, 1)  # [cp, b, h/cp, s, d]: part j for rank j
    got = g.all_to_all(parts)  # got[j]: rank j's rows of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // g.size, g.size * s, d)


def _to_sequence(x: torch.Tensor, g: ContextGroup) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, h, g.size, s // g.size, d).permute(2, 0, 1, 3, 4)  # [cp, b, h/cp, s/cp, d]
    got = g.all_to_all(parts)  # got[j]: head group j of this rank's rows
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * g.size, s // g.size, d)


def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: ContextGroup, causal: bool,
            scale: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention by all-to-all: whole sequences of ``heads / cp`` heads on each rank."""
    heads = q.shape[1]
    if k.shape[1] % g.size:  # grouped keys and values that do not split over cp go as the queries' heads
        k, v = _grouped(k, heads), _grouped(v, heads)
    q, k, v = (_Swap.apply(t, g, True) for t in (q, k, v))
    rows = torch.argsort(g.order)  # position p's row
    q, k, v = (t.index_select(2, rows) for t in (q, k, v))
    mask = None
    if valid is not None:  # the keys' padding in position order, the causal mask folded in
        keys = valid.permute(1, 0, 2).reshape(valid.shape[1], -1).index_select(1, rows)  # [b, s]
        s = keys.shape[1]
        mask = keys[:, None, None, :].expand(keys.shape[0], 1, s, s)
        if causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=keys.device).tril()
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return _Swap.apply(y.index_select(2, g.order), g, False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: ContextGroup, strategy: str, causal: bool,
              scale: float, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of this rank's queries over the group's whole sequence; ``pad``:
    this rank's slice of a padding mask (nonzero: a real token), whose keys no query sees."""
    valid = g.key_mask(pad) if pad is not None else None
    if strategy == "all-to-all":
        return ulysses(q, k, v, g, causal, scale, valid)
    return RingAttention.apply(q, k, v, g, causal, scale, valid)
