"""The packing guard on models with 3-D rotary positions (mRoPE: tiny random Qwen2-VL and Qwen2.5-VL, fp32, CPU).

Qwen2-VL's text model builds the packed mask only from a ``[4, B, T]`` position_ids (row 0 the text positions), so
the text Collator's ``[1, T]`` batch leaks on it (tests/test_vision_exact.py measures it). The guard refuses such a
batch by a static rule naming the fix (``Collator(vision=...)``), and its probe collates its rows the same way, so
that it passes the model exactly where it is exact.
"""

from __future__ import annotations

import pytest
import torch

from packers import Collator, PackstreamError, check_packing_safe, install_packing_guard
from tests._internals import GUARD, attention_probe, cached_verdict, num_sequences
from tests.test_vision_exact import SPECS, make_examples, pack_row, tiny_vl


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


def vision_batch(family: str, images_dir, **collator) -> dict:
    examples = make_examples(SPECS[family], images_dir)
    return Collator(vision=SPECS[family], **collator)([pack_row(examples[:3]), pack_row(examples[3:])])


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_guard_passes_the_vision_collators_batch(family, attn, mode, images_dir):
    model = getattr(tiny_vl(family, attn), mode)()
    batch = vision_batch(family, images_dir)
    check_packing_safe(model, batch)
    verdict = cached_verdict(model, batch)
    assert verdict is not None and verdict.error is None and verdict.diff < 1e-5
    with install_packing_guard(model), torch.no_grad():
        model(**batch)  # the guarded forward runs


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("rows", ["text [1, T]", "mrope [3, 1, T]", "none"])
def test_guard_refuses_packed_batches_without_four_position_rows(family, rows, images_dir):
    model = tiny_vl(family, "sdpa").train()
    batch = vision_batch(family, images_dir)
    if rows == "none":
        del batch["position_ids"]
    else:
        batch["position_ids"] = batch["position_ids"][0] if rows.startswith("text") else batch["position_ids"][1:]
    with pytest.raises(PackstreamError, match=r"mRoPE.*\[4, B, T\].*Collator\(vision=") as e:
        check_packing_safe(model, batch)
    assert "\n" not in str(e.value)
    with install_packing_guard(model), pytest.raises(PackstreamError, match=r"Collator\(vision="):
        model(**batch)


def test_the_text_collators_batch_of_text_rows_is_refused_and_the_vision_collators_passes():
    """Text-only rows too: a Qwen2-VL model needs the 4-row positions for every packed batch."""
    model = tiny_vl("qwen2-vl", "sdpa").train()
    rows = [{"input_ids": [5, 9, 41, 17, 5, 30, 7], "loss_mask": [0, 0, 1, 1, 0, 1, 1], "seq_offsets": [0, 4, 7]}]
    with pytest.raises(PackstreamError, match=r"position_ids of shape \[1, 7\]"):
        check_packing_safe(model, Collator()(rows))
    batch = Collator(vision=SPECS["qwen2-vl"])(rows)
    assert batch["position_ids"][1:].tolist() == batch["position_ids"][:1].expand(3, 1, 7).tolist()
    check_packing_safe(model, batch)


def test_the_probe_with_text_positions_finds_the_leak(monkeypatch):
    """The probe's own batch must be 4-row for an mRoPE model: the same probe with the text Collator's [1, T]
    positions finds Qwen2-VL leaking, exact only once the guard passes the positions to its mask functions
    (``fix``). With the 4 rows it is exact as it is. (The static rule refuses [1, T] batches before any probe:
    the fix would mend the mask, not the images' lost 3-D positions.)"""
    model = tiny_vl("qwen2-vl", "sdpa").eval()
    layout = (("position_ids",), False)
    four = GUARD.probe(model, model, layout)
    assert four.error is None and not four.fix
    monkeypatch.setattr(attention_probe, "uses_mrope", lambda hf: False)
    text = GUARD.probe(model, model, layout)
    assert text.error is None and text.fix


def test_sequences_are_counted_from_the_text_row(images_dir):
    """Images make the mRoPE rows jump; the sequences are counted from row 0 (or where all 3 mRoPE rows are 0)."""
    batch = vision_batch("qwen2-vl", images_dir, decode_images=False)
    pos = batch["position_ids"]
    assert num_sequences({"position_ids": pos}) == 5
    assert num_sequences({"position_ids": pos[1:]}) == 5
    assert num_sequences({"position_ids": pos[0]}) == 5


def test_a_varlen_vision_tower_with_the_texts_boundaries_is_refused(images_dir):
    """transformers passes the batch's cu_seq_lens on to the vision tower: under a varlen backend there they are not
    the images' boundaries. Refused from the config (no GPU needed); without them in the batch it passes the rule."""
    model = tiny_vl("qwen2-vl", "sdpa").eval()
    model.config.vision_config._attn_implementation = "flash_attention_2"
    with pytest.raises(PackstreamError, match=r"vision tower runs under attn_implementation='flash_attention_2'.*"
                                              r"return_flash_attn_kwargs=False"):
        check_packing_safe(model, vision_batch("qwen2-vl", images_dir))
    model.config.vision_config._attn_implementation = "sdpa"
    check_packing_safe(model, vision_batch("qwen2-vl", images_dir, return_flash_attn_kwargs=False))
