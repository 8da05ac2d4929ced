"""The selective scan of Mamba-1 (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with
Selective State Spaces", eq. 2a-2b with the discretisation of eq. 4 and Algorithm 2):

    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t u_t) B_tᵀ        h_t, A: [d_inner, d_state]
    y_t = h_t C_t  (+ D ⊙ u_t)

with B̄ = Δ B (the simplification mamba-ssm's kernels use instead of the exact ZOH of B).
Layout is position-major, as everywhere in hookmech:

    u, delta: [batch, pos, d_inner]    A: [d_inner, d_state]    B, C: [batch, pos, d_state]
    states:   [batch, pos, d_inner, d_state]  (the state after consuming position t)

Side by side:

* `selective_scan_ref`: a Python loop over positions under autograd. Slow, obviously
  right; the tests pin the fast path to it.
* `selective_scan`: a `torch.autograd.Function`. The forward walks time in chunks of
  `chunk` positions; within a chunk it builds exp(Δ A) and Δ u Bᵀ for the chunk only
  (a few MB, so it stays in cache) and runs the recurrence as one in-place multiply-add
  per position; only the chunk-boundary states are kept. The backward walks the chunks in
  reverse, recomputes each chunk's states from its saved start, and runs the adjoint
  recurrence g_t = ∂L/∂h_t + exp(Δ_{t+1} A) ⊙ g_{t+1} backwards in time; every parameter
  gradient is then a contraction of g with one factor. The forward holds a chunk's states
  transposed, ``[d_state, d_inner]``, so that its elementwise steps and read-out run along the long
  axis (the same bytes, `_read_out`); the backward holds them as they are, where its sums over the
  state keep their order (and training its bytes). Nothing of size
  [batch, pos, d_inner, d_state] is ever allocated. (Autograd through a loop of slices
  would record one graph node per step and scatter into the full tensor at each one.)
* `linear_scan`: the bare recurrence h_t = a_t ⊙ h_{t-1} + b_t with its own backward, for
  callers that need the states themselves (the Mamba mixer when its state hook is on).
* `strided_selective_scan`: the forward alone (no autograd) in chunks of `stride` positions,
  keeping each chunk's last state: a resumable run's output and its states every `stride`
  positions, in one pass (the patching engine's base runs).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .base import needs_grad
from .decay_exp import decay_exp_

#: bytes of one position's states above which a forward that autograd does not record scans a
#: block of rows at a time (`selective_scan`): a resumed window stacks hundreds of (patch, row)
#: pairs, and at d_inner 1536 a position's states of 64 of them (6 MB) leave the cache at every
#: step (1.6x slower than blocks of 4 rows, bench/pretrained_engine.py)
ROW_BLOCK_BYTES = 512 << 10
#: positions per chunk of the fast scan; 8-32 measure alike on CPU (bench/mamba_scan.py)
DEFAULT_CHUNK = 16
#: ... but a chunk's states take at most this many bytes: larger blocks are fresh memory from the
#: OS at every chunk (page faults cost more than the scan: 2.3x slower at 256 rows, d_inner 256)
CHUNK_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------
def selective_scan_ref(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    h0: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sequential selective scan, one position at a time (the reference).

    Returns ``(y, states)``: y ``[batch, pos, d_inner]`` (plus ``D ⊙ u`` when `D` is
    given) and the states ``[batch, pos, d_inner, d_state]``; `h0` is the state before
    position 0 (zeros when None).
    """
    batch, n_pos, d_inner = u.shape
    h = u.new_zeros(batch, d_inner, A.shape[1]) if h0 is None else h0
    ys, states = [], []
    for t in range(n_pos):
        decay = torch.exp(delta[:, t, :, None] * A)
        h = decay * h + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
        states.append(h)
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + u * D
    return y, torch.stack(states, dim=1)


# ---------------------------------------------------------------------------------------
# the bare linear recurrence
# ---------------------------------------------------------------------------------------
class _LinearScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        h = b.clone()
        for t in range(1, h.shape[1]):
            h[:, t].addcmul_(a[:, t], h[:, t - 1])
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h: Tensor):
        a, h = ctx.saved_tensors
        g = grad_h.clone()  # adjoint: g_t = ∂L/∂h_t + a_{t+1} g_{t+1}
        for t in range(g.shape[1] - 2, -1, -1):
            g[:, t].addcmul_(a[:, t + 1], g[:, t + 1])
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.zeros_like(g)
            torch.mul(g[:, 1:], h[:, :-1], out=grad_a[:, 1:])
        return grad_a, g


def linear_scan(a: Tensor, b: Tensor, overwrite: bool = False) -> Tensor:
    """Return h ``[batch, pos, ...]``, h_t = a_t ⊙ h_{t-1} + b_t along axis 1 from h_{-1} = 0.

    `a`, `b`: same shape ``[batch, pos, ...]``; differentiable in both. With `overwrite`, a run
    that autograd does not record scans in `b` itself and returns it (the caller's `b` is then
    the states): a state tensor is the largest one a mixer makes, and copying it costs as much as
    the scan.
    """
    if overwrite and not needs_grad(a, b):
        for t in range(1, b.shape[1]):
            b[:, t].addcmul_(a[:, t], b[:, t - 1])
        return b
    return _LinearScan.apply(a, b)


# ---------------------------------------------------------------------------------------
# the fast selective scan
# ---------------------------------------------------------------------------------------
def _chunk_states(
    delta: Tensor, delta_u: Tensor, B: Tensor, A: Tensor, h0: Tensor, state_major: bool = False
) -> tuple[Tensor, Tensor]:
    """States of one chunk, time-major. delta, delta_u ``[T, b, d]``, B ``[T, b, n]``,
    h0 ``[b, d, n]`` (the state before the chunk). Returns (decay, states), ``[T, b, d, n]``.
    With `state_major`, A is transposed ``[n, d]``, h0 ``[b, n, d]`` and both outputs
    ``[T, b, n, d]``: the same numbers, bit for bit (every operation is elementwise)."""
    if state_major:
        decay = decay_exp_(torch.mul(delta[:, :, None, :], A), factors=(delta, A))
        h = B[..., None] * delta_u[:, :, None, :]
    else:
        decay = decay_exp_(torch.mul(delta[..., None], A), factors=(delta, A))
        h = delta_u[..., None] * B[:, :, None, :]
    h[0].addcmul_(decay[0], h0)
    for t in range(1, h.shape[0]):
        h[t].addcmul_(decay[t], h[t - 1])
    return decay, h


def _time_major(x: Tensor) -> Tensor:
    return x.transpose(0, 1).contiguous()


def _read_out(C: Tensor, h: Tensor) -> Tensor:
    """Return y ``[T, b, d]``, y_t = h_t C_t, of state-major states `h` ``[T, b, n, d]`` and C
    ``[T, b, n]``: the bytes the mixer's layout gives (h ``[T, b, d, n]`` times C), which one
    product alone (T·b = 1) computes on another path, so it is read out in that layout."""
    if h.shape[0] * h.shape[1] == 1:
        return torch.matmul(_transposed(h), C[..., None]).squeeze(-1)
    return torch.matmul(C[:, :, None, :], h).squeeze(-2)


def _transposed(x: Tensor) -> Tensor:
    """``[..., p, q]`` -> ``[..., q, p]``, contiguous: A or a state, to or from state-major."""
    return x.transpose(-1, -2).contiguous()


class ScanObserver(Protocol):
    """Called by `selective_scan`'s backward once per chunk, last chunk first: ``(start, h0, decay,
    states, adjoints, after)`` with the chunk's first position `start`, the state before it `h0`
    ``[b, d, n]``, its decays exp(Δ_t A) and states ``[K, b, d, n]``, the adjoints g_t = ∂L/∂h_t
    ``[K, b, d, n]`` and `after` ``[b, d, n]``, exp(Δ_{t+1} A) ⊙ g_{t+1} after the chunk's last
    position t (None for the last chunk). Only read: the backward goes on with them."""

    def __call__(
        self, start: int, h0: Tensor, decay: Tensor, states: Tensor, adjoints: Tensor, after: Tensor | None, /
    ) -> None: ...


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        u: Tensor,
        delta: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        chunk: int,
        h0: Tensor | None,
        observer: ScanObserver | None = None,
    ) -> Tensor:
        # Time-major copies make every h[t] one contiguous block for the in-place loop.
        u, delta, B, C = (_time_major(x) for x in (u, delta, B, C))
        delta_u = delta * u
        n_pos, batch, d_inner = u.shape
        chunk = max(1, min(chunk, CHUNK_BYTES // (batch * d_inner * A.shape[1] * u.element_size())))
        ctx.has_h0 = h0 is not None
        # state-major here (the backward's reductions keep the mixer's layout, as their order does)
        A_t = _transposed(A)
        h0 = u.new_zeros(batch, A.shape[1], d_inner) if h0 is None else _transposed(h0.to(u.dtype))
        y = torch.empty_like(u)
        chunk_starts = []
        for start in range(0, n_pos, chunk):
            part = slice(start, start + chunk)
            chunk_starts.append(h0)
            _, h = _chunk_states(delta[part], delta_u[part], B[part], A_t, h0, state_major=True)
            y[part] = _read_out(C[part], h)
            h0 = h[-1].clone()  # a view would keep the whole chunk's states alive
        ctx.chunk, ctx.observer = chunk, observer
        ctx.save_for_backward(u, delta, A, B, C, delta_u, *chunk_starts)
        return y.transpose(0, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        u, delta, A, B, C, delta_u, *chunk_starts = ctx.saved_tensors
        grad_y = _time_major(grad_y)
        grad_delta_u, grad_delta = torch.empty_like(u), torch.empty_like(u)
        grad_B, grad_C = torch.empty_like(B), torch.empty_like(C)
        grad_A = torch.zeros_like(A)
        # a_{t+1} g_{t+1} from the chunk after the current one (the adjoint's carry)
        carry = None
        for index in reversed(range(len(chunk_starts))):
            start = index * ctx.chunk
            part = slice(start, start + ctx.chunk)
            h0 = _transposed(chunk_starts[index])  # kept state-major by the forward
            decay, h = _chunk_states(delta[part], delta_u[part], B[part], A, h0)
            g = grad_y[part, :, :, None] * C[part, :, None, :]
            if carry is not None:
                g[-1] += carry
            for t in range(g.shape[0] - 2, -1, -1):
                g[t].addcmul_(decay[t + 1], g[t + 1])
            if ctx.observer is not None:
                ctx.observer(start, h0, decay, h, g, carry)
            carry = decay[0] * g[0]
            # y_t = h_t C_t and b_t = (Δ_t u_t) B_tᵀ: contract the adjoints against each factor
            grad_C[part] = torch.matmul(grad_y[part, :, None, :], h).squeeze(-2)
            grad_B[part] = torch.matmul(delta_u[part, :, None, :], g).squeeze(-2)
            grad_delta_u[part] = torch.matmul(g, B[part, :, :, None]).squeeze(-1)
            # a_t = exp(Δ_t A): ∂L/∂(Δ_t A) = g_t ⊙ h_{t-1} ⊙ a_t  (in place on g, done with it)
            grad_log_decay = g.mul_(decay)
            grad_log_decay[1:].mul_(h[:-1])
            grad_log_decay[0].mul_(h0)
            torch.sum(grad_log_decay * A, dim=-1, out=grad_delta[part])
            if ctx.needs_input_grad[2]:  # A's (a parameter's): not asked for by a gradient to activations
                grad_A += (grad_log_decay * delta[part, :, :, None]).sum((0, 1))
        grad_delta.addcmul_(grad_delta_u, u)
        grad_u = grad_delta_u * delta
        # the carry out of the first chunk is ∂L/∂h_{-1}, the initial state's gradient
        grad_h0 = carry if ctx.has_h0 else None
        return (
            grad_u.transpose(0, 1),
            grad_delta.transpose(0, 1),
            grad_A,
            grad_B.transpose(0, 1),
            grad_C.transpose(0, 1),
            None,
            grad_h0,
            None,
        )


def _row_blocks(u: Tensor, A: Tensor) -> list[slice]:
    """Return the blocks of rows of `u` ``[batch, pos, d_inner]`` whose states at a position take at
    most ROW_BLOCK_BYTES (at least one row each)."""
    per_row = u.shape[2] * A.shape[1] * u.element_size()
    size = max(1, ROW_BLOCK_BYTES // per_row)
    return [slice(start, start + size) for start in range(0, u.shape[0], size)]


@torch.no_grad()
def strided_selective_scan(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, stride: int
) -> tuple[Tensor, Tensor]:
    """Return ``(y, kept)``: y ``[batch, pos, d_inner]`` as `selective_scan` without D (the same
    recurrence, the same operations), and kept ``[batch, pos // stride, d_inner, d_state]``, the
    states after positions stride - 1, 2 stride - 1, ... Walks time in chunks of `stride`
    positions, so that no more than a chunk's states exist at once; not differentiable. A block
    of rows at a time, as `selective_scan` (the same bytes: every operation is per row; at
    Mamba-130m's width 8 rows' states leave the cache at every step, 1.7x slower)."""
    blocks = _row_blocks(u, A)
    if len(blocks) == 1:
        return _strided_rows(u, delta, A, B, C, stride)
    parts = [_strided_rows(u[rows], delta[rows], A, B[rows], C[rows], stride) for rows in blocks]
    return torch.cat([y for y, _ in parts]), torch.cat([kept for _, kept in parts])


def _strided_rows(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, stride: int) -> tuple[Tensor, Tensor]:
    """`strided_selective_scan` of one block of rows."""
    u, delta, B, C = (_time_major(x) for x in (u, delta, B, C))
    n_pos, batch, d_inner = u.shape
    delta_u = delta * u
    A_t = _transposed(A)
    h0 = u.new_zeros(batch, A.shape[1], d_inner)
    y = torch.empty_like(u)
    kept = u.new_empty(n_pos // stride, batch, d_inner, A.shape[1])
    for start in range(0, n_pos, stride):
        part = slice(start, start + stride)
        _, h = _chunk_states(delta[part], delta_u[part], B[part], A_t, h0, state_major=True)
        y[part] = _read_out(C[part], h)
        h0 = h[-1].clone()  # a view would keep the whole chunk's states alive
        if h.shape[0] == stride:
            kept[start // stride] = h0.transpose(-1, -2)
    # contiguous: a resume looks rows up in the row-flattened states, which a view would copy whole
    return y.transpose(0, 1), kept.transpose(0, 1).contiguous()


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    h0: Tensor | None = None,
    observer: ScanObserver | None = None,
) -> Tensor:
    """Fast selective scan with a hand-written backward; same maths as `selective_scan_ref`.

    Returns y ``[batch, pos, d_inner]`` (plus ``D ⊙ u`` when `D` is given); the states are
    never materialised (use `linear_scan` when you need them). `h0` ``[batch, d_inner,
    d_state]`` is the state before the first position (zeros when None), e.g. to resume a
    scan; it is differentiable too. `observer`: shown each chunk's states and adjoints by a
    backward pass through y (`ScanObserver`; AtP*'s Mamba effects), never called without one.
    """
    blocks = _row_blocks(u, A)
    if needs_grad(u, delta, A, B, C, h0) or len(blocks) <= 1:
        y = _SelectiveScan.apply(u, delta, A, B, C, chunk, h0, observer)
    else:  # every operation is per row: the same bytes a block of rows at a time, its states in cache
        parts = []
        for rows in blocks:
            h0_rows = None if h0 is None else h0[rows]
            parts.append(_SelectiveScan.apply(u[rows], delta[rows], A, B[rows], C[rows], chunk, h0_rows))
        y = torch.cat(parts)
    if D is not None:
        y = y + u * D
    return y
