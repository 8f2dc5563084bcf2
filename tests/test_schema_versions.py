"""Contract versions 6 (9 with the cuts column), 7 and 8 mark TRL's mask rule; a folder packed before it (3, 4, 5: the same three schemas,
other masks and tokens) is refused in one line that says what changed and to repack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest

from packers import ContractError, PackedDataset, read_metadata
from packers.schema import (CONTRACT_VERSION, MASK_RULE_CHANGE, READABLE_VERSIONS, SCHEMA, SCHEMA_V6, TEXT_VERSIONS,
                            VIDEO_CONTRACT_VERSION,
                            VIDEO_SCHEMA, VISION_CONTRACT_VERSION, VISION_SCHEMA, row_schema)
from tests._shards import pack_first_fit, random_examples, write_shards

README = Path(__file__).resolve().parents[1] / "README.md"


def test_text_versions_6_and_9_and_their_schemas():
    # 9 is 6 plus the cuts column; the image and video schemas are built on 6's columns, unchanged.
    assert (CONTRACT_VERSION, TEXT_VERSIONS, READABLE_VERSIONS) == (9, (6, 9), (6, 7, 8, 9))
    assert row_schema(9) is SCHEMA and row_schema(6) is SCHEMA_V6
    assert SCHEMA.names == SCHEMA_V6.names + ["cuts"] and str(SCHEMA.field("cuts").type) == "list<item: int32>"
    assert not SCHEMA.field("cuts").nullable
    assert VISION_SCHEMA.names[:len(SCHEMA_V6)] == SCHEMA_V6.names and "cuts" not in VIDEO_SCHEMA.names
    for version in (6, 9):  # text versions carry no vision metadata; 7 and 8 must
        assert read_metadata(pa.schema([]).with_metadata({b"packstream.contract_version": str(version).encode()}))
        with pytest.raises(ContractError, match=f"contract version {version} with packstream.vision"):
            read_metadata(pa.schema([]).with_metadata({b"packstream.contract_version": str(version).encode(),
                                                       b"packstream.vision": b'"{}"'}))
    with pytest.raises(ContractError, match="contract version 7 without packstream.vision"):
        read_metadata(pa.schema([]).with_metadata({b"packstream.contract_version": b"7"}))


@pytest.mark.parametrize("old,schema", [(3, SCHEMA_V6), (4, VISION_SCHEMA), (5, VIDEO_SCHEMA)])
def test_a_folder_packed_before_the_trl_mask_rule_is_refused_with_repack(tmp_path, old, schema):
    assert (VISION_CONTRACT_VERSION, VIDEO_CONTRACT_VERSION) == (7, 8) and READABLE_VERSIONS == (6, 7, 8, 9)
    assert row_schema(old + 3) is schema  # the same schema, under the new rule

    def refused(e: pytest.ExceptionInfo) -> str:
        message = str(e.value)
        assert "\n" not in message
        assert f"contract version {old} ({MASK_RULE_CHANGE}); repack it with this packstream" in message, message
        return message

    # The folder: its manifest is read first, so the loader refuses it before opening a shard.
    folder = tmp_path / "out"
    write_shards(folder, pack_first_fit(random_examples(20), 64), budget=64)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["contract_version"] = old
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError) as e:
        PackedDataset(folder)
    assert refused(e).endswith(f"out: manifest.json has contract version {old} ({MASK_RULE_CHANGE}); repack it with "
                               "this packstream (re-run packstream pack on its inputs)")

    # A shard's own metadata (read alone, or a shard of an old run under a new manifest), and the schema lookup.
    meta = {b"packstream.contract_version": str(old).encode(), b"packstream.budget": b"64"}
    if old != 3:
        meta[b"packstream.vision"] = json.dumps("{}").encode()
    with pytest.raises(ContractError) as e:
        read_metadata(schema.with_metadata(meta))
    assert refused(e).startswith(f"shard has contract version {old} (")
    with pytest.raises(ContractError) as e:
        row_schema(old)
    refused(e)

    # Versions 1-2 and unknown ones keep their wording; the README states the change in the constant's words.
    with pytest.raises(ContractError, match=r"^shard has contract version 2, this packstream reads versions 6, 7, 8, 9; "
                                            "repack the data"):
        read_metadata(pa.schema([]).with_metadata({b"packstream.contract_version": b"2"}))
    assert " ".join(MASK_RULE_CHANGE.split()) in " ".join(README.read_text().split())
    assert re.search(r"Version 6 \(7 with\s+images, 8 with videos", README.read_text())
