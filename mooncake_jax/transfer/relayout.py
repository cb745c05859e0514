"""KV re-layout between unlike instances: numpy only, so every conversion is tested without a device.

A prefill instance's blocks arrive as ``[n, layers, 2, block_size, kv_heads, head_dim]`` in its ``KVLayout``; the
decode instance needs them in its own: another page size (16-token pages become 32-token pages, the partial tail
included), another dtype (bfloat16 <-> float32), KV heads split over another number of tensor-parallel devices,
layers split into other stages. ``convert`` does the page size and dtype over gathered blocks; ``split`` /
``gather`` go between gathered blocks and the per-(stage, device) pieces an engine of a given layout holds, so
pieces cut for one layout are regathered and re-cut for another.
"""

from __future__ import annotations

import numpy as np

from ..kv_layout import KVLayout, exchange_problem
from .spec import resolve_dtype


def _check(blocks: np.ndarray, layout: KVLayout, what: str) -> None:
    if blocks.ndim != 6 or blocks.shape[1:] != layout.block_shape:
        raise ValueError(f"{what} have shape {list(blocks.shape)}, the layout {layout.describe()} needs "
                         f"[n, {', '.join(map(str, layout.block_shape))}]")


def tokens_of(blocks: np.ndarray, n_tokens: int) -> np.ndarray:
    """The first ``n_tokens`` tokens' KV of blocks [n, L, 2, B, H, D] as one array [L, 2, n_tokens, H, D]."""
    n, layers, two, block, heads, dim = blocks.shape
    if not 0 <= n_tokens <= n * block:
        raise ValueError(f"{n_tokens} tokens do not fit in {n} blocks of {block}")
    flat = blocks.transpose(1, 2, 0, 3, 4, 5).reshape(layers, two, n * block, heads, dim)
    return flat[:, :, :n_tokens]


def blocks_of(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Tokens' KV [L, 2, T, H, D] cut into pages [ceil(T / block_size), L, 2, block_size, H, D], the tail page's
    unused slots zero."""
    layers, two, n_tokens, heads, dim = tokens.shape
    n = -(-n_tokens // block_size)
    padded = np.zeros((layers, two, n * block_size, heads, dim), tokens.dtype)
    padded[:, :, :n_tokens] = tokens
    return np.ascontiguousarray(padded.reshape(layers, two, n, block_size, heads, dim).transpose(2, 0, 1, 3, 4, 5))


def convert(blocks: np.ndarray, src: KVLayout, dst: KVLayout, n_tokens: int) -> np.ndarray:
    """The KV of ``n_tokens`` tokens held in ``blocks`` (layout ``src``) as blocks of layout ``dst``:
    [ceil(n_tokens / dst.block_size), *dst.block_shape] in ``dst.dtype``. ValueError if the models differ."""
    problem = exchange_problem(src, dst)
    if problem:
        raise ValueError(f"cannot convert KV of {src.describe()} to {dst.describe()}: {problem}")
    blocks = np.asarray(blocks)
    _check(blocks, src, "blocks")
    if blocks.dtype != resolve_dtype(src.dtype):
        raise ValueError(f"blocks are {blocks.dtype.name}, the layout says {src.dtype}")
    out = blocks if src.block_size == dst.block_size else blocks_of(tokens_of(blocks, n_tokens), dst.block_size)
    need = -(-n_tokens // dst.block_size)
    return np.ascontiguousarray(out[:need].astype(resolve_dtype(dst.dtype), copy=False))


def split(blocks: np.ndarray, layout: KVLayout) -> dict[tuple[int, int], np.ndarray]:
    """Gathered blocks [n, L, 2, B, H, D] as the pieces of ``layout``'s devices: (stage, device in stage) ->
    [n, stage's layers, 2, B, device's KV heads, D]."""
    _check(blocks, layout, "blocks")
    return {(s, t): blocks[:, lo:hi, :, :, h0:h1]
            for s, (lo, hi) in enumerate(layout.stage_ranges())
            for t, (h0, h1) in enumerate(layout.head_groups())}


def gather(pieces: dict[tuple[int, int], np.ndarray], layout: KVLayout) -> np.ndarray:
    """The gathered blocks [n, L, 2, B, H, D] from the pieces ``split`` made for ``layout`` (a head held by
    several devices is taken from the first; a piece missing or of the wrong shape is a ValueError)."""
    ranges, groups = layout.stage_ranges(), layout.head_groups()
    expected = {(s, t) for s in range(len(ranges)) for t in range(len(groups))}
    if set(pieces) != expected:
        raise ValueError(f"pieces {sorted(pieces)} are not those of {layout.describe()}: {sorted(expected)}")
    first = pieces[(0, 0)]
    n = first.shape[0]
    out = np.empty((n,) + layout.block_shape, first.dtype)
    for (s, t), piece in pieces.items():
        (lo, hi), (h0, h1) = ranges[s], groups[t]
        want = (n, hi - lo, 2, layout.block_size, h1 - h0, layout.head_dim)
        if piece.shape != want:
            raise ValueError(f"piece (stage {s}, device {t}) has shape {list(piece.shape)}, expected {list(want)}")
        out[:, lo:hi, :, :, h0:h1] = piece
    return out


def relayout_pieces(pieces: dict[tuple[int, int], np.ndarray], src: KVLayout, dst: KVLayout,
                    n_tokens: int) -> dict[tuple[int, int], np.ndarray]:
    """Pieces held by ``src``'s devices as the pieces ``dst``'s devices hold: regathered, re-paged, cast, re-cut."""
    return split(convert(gather(pieces, src), src, dst, n_tokens), dst)
