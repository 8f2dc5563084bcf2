"""packstream's packing core, packed-row contract and training-time loader.

Imports with numpy and pyarrow alone; the loader names (``Collator``, ``PackedDataset``, ``loss``, ``example_losses``,
``sequence_logps``, ``register_varlen_attention``, ``check_packing_safe``, ``PixelLoader``, ...) import torch on first
use; ``PackedDPOTrainer`` and ``PackedKTOTrainer`` (TRL's DPO and KTO on packed rows) also need ``trl``. ``VisionSpec`` and ``mrope_positions`` (vision-language rows: image tokens and 3-D positions) need no torch.
The loader's options (``Sampling``, ``Sharding``, ``Batching`` and the enums and cost model they hold) need no torch.
"""

from packers.errors import ContractError, InternalError, PackstreamError
from packers._options import Balance, Batching, BatchBy, CostModel, LossWeighting, Sampling, Sharding
from packers._pack import LongPolicy, PackResult, Strategy, pack, pack_stream
from packers._pairs import pack_pairs
from packers.schema import (CONTRACT_VERSION, SCHEMA, SCHEMA_V6, TEXT_VERSIONS, VIDEO_CONTRACT_VERSION, VIDEO_SCHEMA, VISION_CONTRACT_VERSION,
                            VISION_SCHEMA, Cut, Side, read_metadata,
                            schema_metadata, shard_schema, validate_row)
from packers._vision import ImageSizeError, VisionFamily, VisionSpec
from packers._stats import PackStats, pack_stats
from packers._mrope import mrope_positions

_TORCH_NAMES = {
    "Collator": "packers._collate",
    "PackedBatch": "packers._collate",
    "PackedDataset": "packers._loader",
    "PackedLoader": "packers._loader",
    "loss": "packers._loss",
    "example_losses": "packers._loss",
    "ExampleLosses": "packers._loss",
    "register_varlen_attention": "packers._attention",
    "check_packing_safe": "packers._attention",
    "install_packing_guard": "packers._attention",
    "GuardHandle": "packers._attention",
    "sequence_logps": "packers._logps",
    "SequenceLogps": "packers._logps",
    "kto_loss": "packers._logps",
    "PixelLoader": "packers._pixels",
    "PackedDPOTrainer": "packers._preference_trainer",
    "PackedKTOTrainer": "packers._preference_trainer",
}

__all__ = [
    "CONTRACT_VERSION",
    "SCHEMA",
    "SCHEMA_V6",
    "Cut",
    "TEXT_VERSIONS",
    "VISION_CONTRACT_VERSION",
    "VISION_SCHEMA",
    "VIDEO_CONTRACT_VERSION",
    "VIDEO_SCHEMA",
    "ImageSizeError",
    "VisionFamily",
    "VisionSpec",
    "Balance",
    "BatchBy",
    "Batching",
    "ContractError",
    "CostModel",
    "InternalError",
    "LongPolicy",
    "LossWeighting",
    "PackResult",
    "PackStats",
    "PackstreamError",
    "Sampling",
    "Sharding",
    "Side",
    "Strategy",
    "mrope_positions",
    "pack",
    "pack_pairs",
    "pack_stats",
    "pack_stream",
    "read_metadata",
    "schema_metadata",
    "shard_schema",
    "validate_row",
    *sorted(_TORCH_NAMES),
]


def __getattr__(name: str):
    # Lazy: the torch-backed loader must not make `import packers` need torch.
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'packers' has no attribute {name!r}")
