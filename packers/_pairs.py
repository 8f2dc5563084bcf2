"""Preference pairs: a pair is one item of :func:`packers.pack`, its two sides adjacent in its row.

A pair ``i`` is two sequences, each its shared prompt then a completion: ``chosen[i]`` and ``rejected[i]`` tokens,
``prompt[i]`` of them the prompt. Packed as one item of ``chosen[i] + rejected[i]`` tokens, it is never split across
rows; the result numbers *sequences* (``2 * i`` the chosen side, ``2 * i + 1`` the rejected side).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Unpack

import numpy as np

from packers._bfd import EMPTY
from packers._pack import LongPolicy, PackKeywords, PackResult, Strategy, _as_lengths, _Options, _pack
from packers.errors import PackstreamError


def _pair_lengths(chosen: object, rejected: object, prompt: object | None) -> tuple[np.ndarray, ...]:
    c, r = _as_lengths(chosen), _as_lengths(rejected)
    if c.shape != r.shape:
        raise PackstreamError(f"{len(c)} chosen lengths for {len(r)} rejected lengths; give one of each per pair")
    if prompt is None:
        return c, r, None
    p = _as_lengths(prompt)
    if p.shape != c.shape:
        raise PackstreamError(f"{len(p)} prompt lengths for {len(c)} pairs; give one per pair")
    bad = (p >= np.minimum(c, r)) & (np.minimum(c, r) > 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise PackstreamError(
            f"pair {i}: prompt of {p[i]} tokens leaves no completion (chosen {c[i]}, rejected {r[i]} tokens); "
            "each side is its prompt then at least one completion token"
        )
    return c, r, p


def truncate_pairs(chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray, budget: int) -> np.ndarray:
    """The completion length ``L`` at which both sides of each pair are cut so that the pair fits ``budget``.

    A side keeps ``prompt + min(completion, L)`` tokens; ``L`` is the largest value for which the
    two sides together hold at most ``budget`` tokens: half the room left by the two prompts when
    both completions are longer than that, else the room the shorter completion leaves. ``-1``
    where even one completion token per side does not fit (``2 * prompt + 2 > budget``).
    Pairs that fit already get their longer completion's length (nothing is cut).

    >>> truncate_pairs(np.array([10, 10, 8, 5]), np.array([10, 4, 8, 6]), np.array([2, 2, 6, 2]), budget=12)
    array([ 4,  6, -1,  4])
    """
    cc, rc = chosen - prompt, rejected - prompt
    room = budget - 2 * prompt
    short, longer = np.minimum(cc, rc), np.maximum(cc, rc)
    cut = np.where(2 * short >= room, room // 2, np.minimum(room - short, longer))
    cut = np.where(chosen + rejected <= budget, longer, cut)
    return np.where(room >= 2, cut, -1)


@dataclasses.dataclass(frozen=True)
class _Kept:
    """What each pair keeps of its sides (all of them, unless ``long="truncate"`` cut a long pair's completions)."""

    chosen: np.ndarray
    rejected: np.ndarray
    cut_sides: np.ndarray
    """The sequences (``2 * i``, ``2 * i + 1``) that were cut, sorted."""
    cut_tokens: int


def _keep(c: np.ndarray, r: np.ndarray, p: np.ndarray | None, opts: _Options) -> _Kept:
    """Both sides whole, except that ``long="truncate"`` cuts both completions of a pair over the budget at one
    length (:func:`truncate_pairs`); a pair whose two prompts leave no room is left long (and then dropped)."""
    keep_c, keep_r = c.copy(), r.copy()
    is_long = c + r > opts.budget
    if not (is_long.any() and opts.long is LongPolicy.TRUNCATE):
        return _Kept(keep_c, keep_r, EMPTY, 0)
    if p is None:
        raise PackstreamError("long='truncate' cuts both completions at one length: pass prompt=[...] lengths")
    i = np.flatnonzero(is_long & (c > 0) & (r > 0))
    cut = truncate_pairs(c[i], r[i], p[i], opts.budget)
    ok = cut >= 0
    i, cut = i[ok], cut[ok]
    keep_c[i] = p[i] + np.minimum(c[i] - p[i], cut)
    keep_r[i] = p[i] + np.minimum(r[i] - p[i], cut)
    cut_tokens = int((c[i] - keep_c[i]).sum() + (r[i] - keep_r[i]).sum())
    seq = np.stack([2 * i, 2 * i + 1], axis=1).ravel()
    was = np.stack([c[i] > keep_c[i], r[i] > keep_r[i]], axis=1).ravel()
    return _Kept(keep_c, keep_r, np.sort(seq[was]), cut_tokens)


def _sides(pairs: np.ndarray) -> np.ndarray:
    """The sequences of ``pairs``: ``2 * i`` then ``2 * i + 1`` for each."""
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).ravel()


def pack_pairs(
    chosen: Sequence[int] | np.ndarray,
    rejected: Sequence[int] | np.ndarray,
    budget: int,
    strategy: Strategy | str = Strategy.BFD,
    *,
    prompt: Sequence[int] | np.ndarray | None = None,
    **options: Unpack[PackKeywords],
) -> PackResult:
    """Pack preference pairs into rows of at most ``budget`` tokens; a pair is never split across rows.

    ``chosen[i]`` and ``rejected[i]`` are the token lengths of pair ``i``'s two sequences (each its
    prompt, then its completion); ``prompt[i]`` is the length of the prompt they share. Each pair is
    one item of the summed length, placed by ``strategy`` as :func:`pack` places an example. The
    result numbers *sequences*: ``2 * i`` is pair ``i``'s chosen side, ``2 * i + 1`` its rejected
    side, and in every row each pair's two sides are adjacent, chosen first. ``options`` are
    :func:`pack`'s keyword options (``long``, ``max_per_row``, ``seed``, ``refine``).

    A pair longer than the budget follows ``long``: ``drop`` lists both sides in ``dropped``;
    ``truncate`` cuts both completions at one common length (:func:`truncate_pairs`; needs
    ``prompt``), listing the sides it cut in ``truncated``, and drops a pair whose two prompts alone
    leave no room for a completion token each; ``split`` is refused (half a pair trains nothing).
    ``max_per_row`` counts sequences (two per pair).

    >>> r = pack_pairs([6, 3, 9], [5, 4, 9], budget=12, prompt=[2, 1, 3])
    >>> r.rows, r.stops, r.dropped        # pair 0 (11 tokens) | pair 1 (7); pair 2 (18) dropped
    ([array([0, 1]), array([2, 3])], array([6, 5, 3, 4]), array([4, 5]))
    >>> t = pack_pairs([6, 3, 9], [5, 4, 9], budget=12, prompt=[2, 1, 3], long="truncate")
    >>> t.rows, t.stops, t.truncated      # pair 2: both completions cut to 3 tokens
    ([array([4, 5]), array([0, 1]), array([2, 3])], array([6, 6, 6, 5, 3, 4]), array([4, 5]))
    """
    opts = _Options(budget=budget, strategy=strategy, **options)
    if opts.long is LongPolicy.SPLIT:
        raise PackstreamError(
            "long='split' cannot split a preference pair (each side needs its whole prompt, and half a pair trains "
            "nothing); use long='truncate' (both completions cut at one length) or long='drop'"
        )
    if opts.max_per_row is not None and opts.max_per_row < 2:
        raise PackstreamError(f"max_per_row={opts.max_per_row} is less than one pair (2 sequences); use at least 2")
    c, r, p = _pair_lengths(chosen, rejected, prompt)
    kept = _keep(c, r, p, opts)
    items = np.where((c == 0) | (r == 0), 0, kept.chosen + kept.rejected)
    pair_opts = dataclasses.replace(
        opts, long=LongPolicy.DROP, max_per_row=None if opts.max_per_row is None else opts.max_per_row // 2
    )
    pr = _pack(items, pair_opts)
    order = _sides(pr.order)
    result = PackResult(
        order=order,
        starts=np.zeros(len(order), dtype=np.int64),
        stops=np.stack([kept.chosen[pr.order], kept.rejected[pr.order]], axis=1).ravel(),
        row_offsets=2 * pr.row_offsets,
        budget=opts.budget,
        strategy=opts.strategy,
        long=opts.long,
        max_per_row=opts.max_per_row,
        num_examples=2 * len(c),
        dropped=_sides(pr.dropped),
        empty=_sides(pr.empty),
        truncated=kept.cut_sides,
        dropped_tokens=int((c + r)[pr.dropped].sum()),
        truncated_tokens=kept.cut_tokens,
    )
    result.__dict__["row_lengths"] = pr.row_lengths
    return result
