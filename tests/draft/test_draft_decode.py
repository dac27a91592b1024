"""The draft's lean decode step (``models/decode.py``) against transformers' own forward of the same draft."""

from __future__ import annotations

import pytest
import torch

from specter.assets import DEFAULT_MODEL
from specter.draft.runner import DraftModel
from specter.models.decode import LEAN_FAMILIES

# Steps after the prompt: one token, a catch-up of two or three, and crops of a rejected suffix.
_STEPS = (1, 1, 2, 1, 3, "crop", 1, 2, "crop", 1)


def _same_steps(folder: str, dtype: torch.dtype, vocab: int, prompt_len: int = 7, fused: bool = False,
                step: str = "eager", draft: DraftModel | None = None) -> None:
    """Lean and eager steps agree: bit for bit unfused, to rounding (and the same routing) fused."""
    lean = draft or DraftModel.load(folder, device="cpu", mode="dequant-cache", dtype=dtype, fused=fused, step=step)
    eager = DraftModel.load(folder, device="cpu", mode="dequant-cache", dtype=dtype, lean=False)
    assert lean.lean is not None and eager.lean is None
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen)
    caches = {id(m): m.new_cache() for m in (lean, eager)}
    for model in (lean, eager):
        model.forward(prompt, caches[id(model)])
    for at, step in enumerate(_STEPS):
        if step == "crop":
            for model in (lean, eager):
                cache = caches[id(model)]
                model.crop(cache, cache.get_seq_length() - 2)
            continue
        ids = torch.randint(0, vocab, (1, int(step)), generator=gen)
        want, want_routing = eager.forward(ids, caches[id(eager)]), dict(eager.last_routing)
        got, got_routing = lean.forward(ids, caches[id(lean)]), dict(lean.last_routing)
        assert got_routing.keys() == want_routing.keys() and got_routing
        if fused:
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            for layer, (ids_want, probs_want) in want_routing.items():
                assert torch.equal(got_routing[layer][0], ids_want)
                torch.testing.assert_close(got_routing[layer][1], probs_want, rtol=tol, atol=tol)
            continue
        assert torch.equal(got, want), f"step {at} ({step} tokens): max |diff| {float((got - want).abs().max())}"
        for layer, (ids_want, probs_want) in want_routing.items():
            assert torch.equal(got_routing[layer][0], ids_want) and torch.equal(got_routing[layer][1], probs_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_lean_steps_are_transformers_forward_bit_for_bit(family, dtype, draft_dir) -> None:
    """Logits and the routing the draft predicts with, step by step, equal transformers' forward."""
    _same_steps(str(draft_dir(family, "awq")), dtype, vocab=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_steps_are_transformers_forward_bit_for_bit_on_the_shipped_model(dtype) -> None:
    _same_steps(str(DEFAULT_MODEL) + "-awq", dtype, vocab=4096, prompt_len=20)


@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_fused_steps_route_as_transformers_forward_and_match_its_logits(family, draft_dir) -> None:
    """The fused step (the default): the same routing, logits to rounding, in fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        _same_steps(str(draft_dir(family, "awq")), dtype, vocab=128, fused=True)


def test_a_decode_step_does_not_enter_transformers_forward_and_a_prompt_does(draft_dir) -> None:
    draft = DraftModel.load(draft_dir("qwen2_moe", "awq"), device="cpu", mode="dequant-cache")
    calls: list[int] = []
    draft.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    cache = draft.new_cache()
    draft.forward(torch.tensor([[1, 2, 3]]), cache)  # the prompt: transformers' forward
    assert calls == [1]
    draft.forward(torch.tensor([[4]]), cache)
    draft.forward(torch.tensor([[5, 6]]), cache)
    assert calls == [1] and cache.get_seq_length() == 6
    with pytest.raises(ValueError, match="input_ids"):
        draft.lean(torch.tensor([[1, 2]]), draft.new_cache())  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_a_steps_rotation_is_its_own_call_of_the_rotary_bit_for_bit(family, dtype, draft_dir) -> None:
    """The rotation a step takes from the table (``LeanStep.rotation``, no op) equals the rotary's call at
    those positions alone, bit for bit, past the table's first size too (it grows)."""
    draft = DraftModel.load(draft_dir(family, "awq"), device="cpu", mode="dequant-cache", dtype=dtype)
    lean = draft.lean
    assert lean is not None
    weight = lean.inner.embed_tokens.weight
    for start, tokens in [(0, 1), (7, 3), (255, 2), (300, 1), (611, 4), (40, 1)]:
        cos, sin = lean.rotation(start, tokens)
        want_cos, want_sin = lean.rotary(weight, torch.arange(start, start + tokens)[None])
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (start, tokens)
        assert cos.dtype == dtype and cos.shape == want_cos.shape


def test_other_families_take_transformers_forward(draft_dir) -> None:
    draft = DraftModel.load(draft_dir("deepseek_v2", "awq"), device="cpu", mode="dequant-cache")
    assert draft.lean is None
    cache = draft.new_cache()
    draft.forward(torch.tensor([[1, 2, 3]]), cache)
    assert draft.forward(torch.tensor([[4]]), cache).shape == (1, 1, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_static_steps_route_as_transformers_forward_and_match_its_logits(family, dtype, draft_dir) -> None:
    """The step a GPU captures as a CUDA graph (``models/graphed.py``), run eagerly over the static
    cache — one-token steps at the device-side position over the whole capacity, catch-ups and crops
    by slicing — routes as transformers' forward does and matches its logits to rounding."""
    _same_steps(str(draft_dir(family, "awq")), dtype, vocab=128, fused=True, step="static")


def test_a_static_cache_that_fills_doubles_and_keeps_its_positions(draft_dir) -> None:
    """Steps past the capacity move the buffers (a new capture on a GPU) and lose nothing held."""
    from specter.models.graphed import StaticKV

    folder = str(draft_dir("qwen2_moe", "awq"))
    static = DraftModel.load(folder, device="cpu", mode="dequant-cache", step="static")
    assert static.graphed is not None
    static.graphed.cache = StaticKV.for_model(static.model, capacity=4)
    _same_steps(folder, torch.float32, vocab=128, prompt_len=3, fused=True, step="static", draft=static)
    assert static.graphed.cache.capacity >= 16 and static.graphed.cache.version >= 2


def test_a_static_cache_crops_as_a_dynamic_cache_does() -> None:
    from transformers import DynamicCache

    from specter.models.graphed import StaticKV

    static, dynamic = StaticKV(2, 1, 4, torch.float32, torch.device("cpu"), capacity=2), DynamicCache()
    for _ in range(3):
        for layer in range(2):
            dynamic.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), layer)
    static.absorb(dynamic)  # 6 positions into a capacity of 2: it doubles, keeping them
    assert static.capacity == 8
    for cut in (-1, 0, -2):
        static.crop(cut)
        dynamic.crop(cut)
        assert static.get_seq_length() == dynamic.get_seq_length()
        for layer in range(2):
            keys, values = static.keys_values(layer)  # one buffer a layer: keys' heads, then values'
            torch.testing.assert_close(keys[:, :, : static.length], dynamic.layers[layer].keys)
            torch.testing.assert_close(values[:, :, : static.length], dynamic.layers[layer].values)
    with pytest.raises(ValueError, match="tokens_to_remove"):
        static.crop(-4)
    with pytest.raises(ValueError, match="tokens_to_remove"):
        static.crop(1)


def test_a_step_mode_the_draft_cannot_take_is_refused_by_name(draft_dir) -> None:
    folder = str(draft_dir("qwen2_moe", "awq"))
    with pytest.raises(ValueError, match="step: expected one of"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache", step="compiled")
    with pytest.raises(ValueError, match="step: 'graph' needs a CUDA device"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache", step="graph")
    with pytest.raises(ValueError, match="dequant-cache"):
        DraftModel.load(folder, device="cpu", mode="dequant-on-the-fly", step="static")
    assert DraftModel.load(folder, device="cpu", mode="dequant-cache").step_mode == "eager"  # auto on a CPU
