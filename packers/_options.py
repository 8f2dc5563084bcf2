"""The options of :class:`packers.PackedDataset`, in three frozen groups, each checked when it is made.

* :class:`Sampling`: what is drawn at random each epoch (``shuffle``, ``seed``, ``rebatch``);
* :class:`Sharding`: which rank this process is (``rank``, ``world_size``; torch.distributed's by default);
* :class:`Batching`: what a micro-batch and an optimizer step hold (``batch_size`` units of ``batch_by``,
  ``grad_accum``), how a step's rows are dealt to the ranks (``balance`` by ``cost``), and what each token counts
  in its step's loss (``loss_weighting``, ``source_weights``).

>>> Batching(batch_by="examples", batch_size=16).batch_by
<BatchBy.EXAMPLES: 'examples'>
>>> Sampling(seed=-1)
Traceback (most recent call last):
...
packers.errors.PackstreamError: seed=-1 must be an integer >= 0 (numpy's generators take non-negative seeds); use e.g. seed=0

Pure Python and numpy: importable without torch (``bench/bench_balance.py`` schedules epochs on real lengths).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packers.errors import PackstreamError, check_int, is_int, is_weight, parse_enum, short


class BatchBy(str, enum.Enum):
    """What ``batch_size`` counts in a :class:`packers.PackedDataset` micro-batch."""

    ROWS = "rows"
    EXAMPLES = "examples"
    TOKENS = "tokens"


class Balance(str, enum.Enum):
    """How a step's rows are dealt to the ranks (:mod:`packers._schedule`)."""

    COMPUTE = "compute"
    """Rows of similar cost ``alpha * sum(l) + beta * sum(l**2)`` (a :class:`CostModel`) to different ranks."""
    TOKENS = "tokens"
    """The same, with the row's token count as its cost."""
    NONE = "none"
    """The shuffled rows cut into micro-batches in order."""


class LossWeighting(str, enum.Enum):
    """How each trained token counts in the loss of its optimizer step (``packers.loss``)."""

    TOKEN = "token"
    """Every target token alike: the step's loss is the mean over its target tokens (HF ``num_items_in_batch``)."""
    EXAMPLE = "example"
    """Every example alike: the mean over the step's examples of each example's mean token loss."""
    SOURCE = "source"
    """Tokens weighted by their data set's ``loss_weight`` (from the ``--config`` mix): a weighted token mean."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Cost of a row holding examples of lengths ``l``: ``alpha * sum(l) + beta * sum(l**2)``.

    ``alpha`` is what a token costs in the layers that see one token at a time (projections, MLP, the LM
    head); ``beta`` what a pair of tokens of one example costs in attention. Only their ratio matters for
    balancing; in FLOPs (from :meth:`from_config`) the cost also models step time. The default is the ratio
    of a dense 8B-class model (hidden 4096): a 4,096-token example costs about 1.1 times forty of 102 tokens
    in linear layers plus attention.

    >>> CostModel.from_config(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                            intermediate_size=128, vocab_size=100)).beta
    768.0
    """

    alpha: float = 1.0
    """Cost per token."""
    beta: float = 1.0 / (12 * 4096)
    """Cost per token pair of one example (per unit of ``l**2``)."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not is_weight(v):
                raise PackstreamError(f"CostModel {name}={short(v)} must be a finite number >= 0")
        if self.alpha == 0 and self.beta == 0:
            raise PackstreamError("CostModel alpha=0 and beta=0: every row would cost nothing; give one of them > 0")

    def of(self, lengths: np.ndarray) -> np.ndarray:
        """The cost of sequences of ``lengths`` (elementwise)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.alpha * lengths + self.beta * lengths * lengths

    @classmethod
    def from_config(cls, config: Any, *, max_tokens: int | None = None) -> "CostModel":
        """FLOPs of a forward and backward pass (3x the forward's) of a transformers config (or a dict of its keys).

        Per token (``alpha``): 6 FLOPs per weight a token passes through: attention projections, the MLP (the
        routed experts' share and shared experts for MoE, from ``num_experts_per_tok``), the LM head. Per pair
        of tokens of one example (``beta``): 6 x heads x head_dim per full-attention layer (QK^T and AV, causal,
        forward and backward). A sliding-window or chunked layer of window ``w`` counts ``w`` pairs per token,
        in ``alpha``, unless ``max_tokens`` (the row budget) is within the window, where it is full attention.
        Linear-attention and state-space layers count only in ``alpha``.
        """
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        if not isinstance(config, dict) and hasattr(config, "get_text_config"):
            text = config.get_text_config(decoder=True)
            get = lambda k, d=None: getattr(text, k, d)  # noqa: E731
        d = _first_int(get, ("hidden_size", "n_embd", "d_model", "dim"))
        layers = _first_int(get, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
        heads = _first_int(get, ("num_attention_heads", "n_head", "num_heads", "n_heads"))
        if not (d and layers and heads):
            raise PackstreamError(
                "CostModel.from_config needs hidden_size, num_hidden_layers and num_attention_heads in the config; "
                "give CostModel(alpha=..., beta=...) or CostModel.fit(...) instead"
            )
        head_dim = _first_int(get, ("head_dim",)) or d // heads
        kv = _first_int(get, ("num_key_value_heads", "num_kv_heads")) or heads
        ffn = _first_int(get, ("intermediate_size", "ffn_dim", "n_inner")) or 4 * d
        vocab = _first_int(get, ("vocab_size",)) or 0
        experts_per_tok = _first_int(get, ("num_experts_per_tok", "moe_topk", "top_k"))
        moe_ffn = _first_int(get, ("moe_intermediate_size", "expert_intermediate_size")) or ffn
        shared = _first_int(get, ("n_shared_experts", "num_shared_experts")) or 0
        attn_params = d * heads * head_dim * 2 + d * kv * head_dim * 2  # q, o; k, v
        mlp = 3 * d * (experts_per_tok * moe_ffn + shared * moe_ffn) if experts_per_tok else 3 * d * ffn
        types = get("layer_types") or []
        window = _first_int(get, ("sliding_window",))
        chunk = _first_int(get, ("attention_chunk_size",))
        alpha = 6.0 * (layers * (attn_params + mlp) + d * vocab)
        beta = 0.0
        pair = 12.0 * heads * head_dim  # per (query, key) pair of one example, per layer: QK^T + AV, fwd + bwd
        for i in range(layers):
            kind = types[i] if i < len(types) else ("sliding_attention" if window else "full_attention")
            w = chunk if "chunk" in kind else window if "sliding" in kind else None
            if "linear" in kind or "mamba" in kind or "conv" in kind:
                continue
            if w and not (max_tokens is not None and max_tokens <= w):
                alpha += pair * w  # about w keys per query once the example is longer than the window
            else:
                beta += pair / 2  # l**2 / 2 pairs under a causal mask
        return cls(alpha=alpha, beta=beta)

    @classmethod
    def fit(cls, rows: Sequence[Sequence[int]], seconds: Sequence[float]) -> "CostModel":
        """Least squares of measured step times on ``[sum(l), sum(l**2)]`` per row (``rows[i]``: the example
        lengths of a row or micro-batch timed at ``seconds[i]``), coefficients clipped at 0. In seconds."""
        if len(rows) != len(seconds) or len(rows) < 2:
            raise PackstreamError(f"CostModel.fit needs >= 2 timings, one per row: got {len(rows)} rows, {len(seconds)} times")
        x = np.array([[sum(r), sum(v * v for v in r)] for r in rows], dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        scale = x.max(axis=0)
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
        alpha, beta = np.clip(coef / scale, 0.0, None)
        if alpha == 0 and beta == 0:
            raise PackstreamError("CostModel.fit: the timings do not grow with the rows' lengths; time longer rows")
        return cls(alpha=float(alpha), beta=float(beta))


def _first_int(get: Any, keys: Sequence[str]) -> int | None:
    for k in keys:
        v = get(k)
        if is_int(v) and v > 0:
            return v
    return None


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise PackstreamError(f"{name}={short(value)} must be True or False")


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What is drawn at random each epoch; the same on every rank. Saved in the dataset's state dict."""

    shuffle: bool = True
    """Draw each epoch's schedule at random (seeded); False: rows in shard order, deterministic (evaluation)."""
    seed: int = 0
    """The same on every rank."""
    rebatch: bool = True
    """Form new micro-batches every epoch; False keeps the first epoch's and only reorders its steps."""

    def __post_init__(self) -> None:
        _check_flag(self.shuffle, "shuffle")
        _check_flag(self.rebatch, "rebatch")
        if not (is_int(self.seed) and self.seed >= 0):
            raise PackstreamError(f"seed={short(self.seed, 40)} must be an integer >= 0 (numpy's generators take "
                                  "non-negative seeds); use e.g. seed=0")
        object.__setattr__(self, "seed", int(self.seed))


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Which rank this process is, of how many. Left None, each is torch.distributed's when it is initialised
    (else rank 0 of 1) at the time the dataset is made."""

    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size is not None:
            object.__setattr__(self, "world_size", check_int(
                self.world_size, "world_size", fix="pass the number of ranks that train together"))
        if self.rank is not None:
            object.__setattr__(self, "rank", check_int(
                self.rank, "rank", low=0, fix="pass this process's rank, from 0 to world_size - 1"))
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise PackstreamError(f"rank={self.rank} must be in [0, world_size={self.world_size}); pass this "
                                  f"process's rank, from 0 to {self.world_size - 1}")

    def resolved(self) -> "Sharding":
        """Both set: the ones given, torch.distributed's for the others when it is initialised, else rank 0 of 1."""
        if self.rank is not None and self.world_size is not None:
            return self
        rank, world = 0, 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        return Sharding(rank=rank if self.rank is None else self.rank,
                        world_size=world if self.world_size is None else self.world_size)


@dataclass(frozen=True, kw_only=True)
class Batching:
    """What a micro-batch (one rank, one step) and an optimizer step hold, how a step's rows are dealt to the ranks,
    and what each token counts in its step's loss. Saved in the dataset's state dict (but ``source_weights``)."""

    batch_size: int = 1
    """Units of ``batch_by`` per micro-batch; for ``examples``, a target; for ``tokens``, a cap (>= the row budget)."""
    batch_by: BatchBy = BatchBy.ROWS
    """Count rows, packed examples (pairs, in a run of pairs), or tokens."""
    grad_accum: int = 1
    """Micro-batches per rank in one optimizer step (the loss denominators span them)."""
    balance: Balance = Balance.COMPUTE
    """How a step's rows are dealt to ranks: see :class:`Balance`."""
    cost: CostModel = field(default_factory=CostModel)
    """The row cost for ``balance="compute"``."""
    loss_weighting: LossWeighting = LossWeighting.TOKEN
    """How each target token counts in its optimizer step's loss: see :class:`LossWeighting`."""
    source_weights: Mapping[str, float] | None = None
    """With ``loss_weighting="source"``: a loss weight per data set of the run, by name; None takes the ``--config``
    data sets' ``loss_weight``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", check_int(self.batch_size, "batch_size", fix="e.g. batch_size=8"))
        object.__setattr__(self, "grad_accum", check_int(self.grad_accum, "grad_accum", fix="1 for no accumulation"))
        object.__setattr__(self, "batch_by", parse_enum(BatchBy, self.batch_by, "batch_by"))
        object.__setattr__(self, "balance", parse_enum(Balance, self.balance, "balance"))
        object.__setattr__(self, "loss_weighting", parse_enum(LossWeighting, self.loss_weighting, "loss_weighting"))
        if not isinstance(self.cost, CostModel):
            raise PackstreamError(f"cost={short(self.cost)}; pass a packers.CostModel "
                                  "(e.g. CostModel.from_config(model.config))")
        if self.source_weights is not None:
            if self.loss_weighting is not LossWeighting.SOURCE:
                raise PackstreamError(f"source_weights= is read with loss_weighting='source' only, got "
                                      f"{self.loss_weighting.value!r}")
            if not isinstance(self.source_weights, Mapping):
                raise PackstreamError(f"source_weights={short(self.source_weights)}; pass a dict of data set name "
                                      "to loss weight")
            object.__setattr__(self, "source_weights", dict(self.source_weights))
            for name, w in self.source_weights.items():
                check_loss_weight(name, w)


def check_loss_weight(name: object, weight: object) -> None:
    """A data set's loss weight: a finite number >= 0."""
    if not is_weight(weight):
        raise PackstreamError(f"loss weight {short(weight)} of data set {short(name)} must be a finite number >= 0")


_GROUPS = {"sampling": Sampling, "sharding": Sharding, "batching": Batching}

GONE = {"drop_last": "drop_last= is gone: every epoch's schedule trains every example exactly once and gives every "
                     "rank the same number of steps (nothing repeated, nothing dropped); remove it"}
"""Keywords PackedDataset once took that no group holds now, each with why and the fix."""


def _shown(value: object) -> str:
    """An old keyword's value as the new spelling writes it: an enum by its value (``'tokens'``, which the groups
    take), anything else by :func:`short`."""
    return short(value.value if isinstance(value, enum.Enum) else value, 40)


def regrouped(given: Mapping[str, Any], own: Sequence[str]) -> str:
    """The one-line error for keywords ``PackedDataset`` does not take: each flat keyword of the old signature
    (``batch_size=``, ``rank=``, ``seed=``, ...) spelled in its group, ``drop_last=`` said to be gone, and any
    other keyword named with the ones it does take (``own``), and the nearest of them or of the groups' fields.

    >>> print(regrouped({"batch_size": 8, "rank": 0, "world_size": 2}, ["split", "batching"]))
    PackedDataset(batch_size=8, rank=0, world_size=2) takes its options in groups now: batching=Batching(batch_size=8), sharding=Sharding(rank=0, world_size=2)
    >>> print(regrouped({"shufle": True}, ["split", "sampling"]))
    PackedDataset(shufle=True): shufle= is not an option (did you mean sampling=Sampling(shuffle=...)?); PackedDataset takes a path and split=, sampling=
    """
    import difflib
    from dataclasses import MISSING, fields

    group_of = {f.name: (group, f) for group, cls in _GROUPS.items() for f in fields(cls)}
    moved: dict[str, list[str]] = {}
    for key, value in given.items():
        if key in group_of:
            group, f = group_of[key]
            default = f.default_factory() if f.default is MISSING else f.default
            # an old default the group spells another way (cost=None meant the default CostModel) is left out
            fits = value is not None or default is None
            moved.setdefault(group, []).extend([f"{key}={_shown(value)}"] if fits else [])
    call = "PackedDataset(" + ", ".join(f"{key}={_shown(value)}" for key, value in given.items()) + ")"
    if moved:
        call += " takes its options in groups now: " + ", ".join(
            f"{group}={_GROUPS[group].__name__}({', '.join(args)})" for group, args in moved.items())
    parts = [GONE[key] for key in given if key in GONE]
    for key in given:
        if key in group_of or key in GONE:
            continue
        near = difflib.get_close_matches(key, [*own, *group_of], n=1, cutoff=0.7)
        hint = "" if not near else f" (did you mean {near[0]}=?)" if near[0] in own else (
            f" (did you mean {group_of[near[0]][0]}={_GROUPS[group_of[near[0]][0]].__name__}({near[0]}=...)?)")
        parts.append(f"{key}= is not an option{hint}")
    if any(key not in group_of and key not in GONE for key in given):
        parts.append(f"PackedDataset takes a path and {', '.join(f'{k}=' for k in own)}")
    return call + ("; " if moved and parts else ": " if parts else "") + "; ".join(parts)
