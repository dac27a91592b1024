"""The offloaded target is transformers: same greedy tokens, same logits, at every budget."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, noisy_copy
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.generation import generate
from specter.models.decode import LEAN_FAMILIES
from specter.models.graphed import StaticKV
from specter.plan import POLICIES, drafts
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 12
FAST_LINK = LinkConfig(kind="sim", bandwidth=5e9, latency=0.0)


def _reference(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()


def _budget(name: str, model) -> SlotConfig:
    if name == "min":
        return SlotConfig(experts=model.config.num_experts_per_tok)
    return SlotConfig(fraction=float(name))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family, tiny_dir):
    folder = tiny_dir(family)
    ref = _reference(folder)
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = out[0, len(PROMPT):].tolist()
    for budget in ("1.0", "0.5", "min"):
        target = OffloadedTarget.load(folder, _budget(budget, ref), FAST_LINK)
        try:
            tokens, stats = generate(target, PROMPT, NEW)
        finally:
            target.close()
        assert tokens == expected, f"{family} at budget {budget}"
        if budget == "1.0":
            assert stats.misses == 0
        if budget == "min":
            assert stats.misses > 0 and stats.bytes_moved > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_logits_equal_resident_logits(family, tiny_dir):
    folder = tiny_dir(family)
    ref = _reference(folder)
    ids = torch.tensor([PROMPT + [3, 77, 12, 9, 100]])
    with torch.no_grad():
        expected = ref(ids).logits.float()
    # Minimum budget, per layer: the 12-token prefill touches more experts than fit, so they stream.
    target = OffloadedTarget.load(folder, SlotConfig(experts=ref.config.num_experts_per_tok, per_layer=True), FAST_LINK)
    try:
        got = target.forward(ids, target.new_cache())
    finally:
        target.close()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_experts_are_never_materialized_fused(tiny_dir):
    target = OffloadedTarget.load(tiny_dir("mixtral"), SlotConfig(fraction=0.5), FAST_LINK)
    try:
        names = [n for n, _ in target.model.named_parameters()]
        assert not any("gate_up_proj" in n or "experts.down_proj" in n for n in names)
        store = target.offload.store
        blob = store.blob(1, 3)
        assert blob.is_contiguous() and blob.numel() == store.shape.numel
    finally:
        target.close()


@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_the_pieces_a_gpu_graphs_decode_as_transformers_generate(family, tiny_dir):
    """``step="static"``: the target's steps after the prompt as the pieces a GPU captures
    (``models/graphed.py``: dense parts over a fixed-capacity cache, experts between pieces), run
    eagerly — at every budget the greedy tokens are transformers', with the experts in slots computed
    by the slot graphs between pieces and without them; a capacity of 4 positions makes the cache
    double while decoding."""
    folder = tiny_dir(family)
    ref = _reference(folder)
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for budget, slot_graphs in (("1.0", True), ("min", True), ("min", False)):
        target = OffloadedTarget.load(folder, _budget(budget, ref), FAST_LINK, step="static")
        assert target.graphed is not None and target.graphed.splits
        target.graphed.cache = StaticKV.for_model(target.model, capacity=4)
        target.graphed.slot_graphs = slot_graphs
        try:
            tokens, _ = generate(target, PROMPT, NEW)
        finally:
            target.close()
        assert tokens == out[0, len(PROMPT):].tolist(), f"{family} at budget {budget}, slot graphs {slot_graphs}"
        assert target.graphed.cache.capacity == 32
        # every expert resident: the step in one piece, its experts inside; offloaded: cut at each layer
        assert bool(target.graphed.whole) == (budget == "1.0") and bool(target.graphed.pieces) == (budget == "min")
        assert all(pieces.inside == slot_graphs for pieces in target.graphed.pieces.values())


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_every_policy_in_the_pieces_a_gpu_graphs_decodes_as_transformers_generate(family, tiny_dir, tmp_path):
    """``step="static"`` at the minimum budget, every policy (its draft a noisy copy of the target, 4 a
    round): the split layers' experts in slots computed by the slot graphs (several replays a layer
    as experts land; the host's experts into the same pair outputs where the policy computes some
    there), the tokens transformers'."""
    folder = tiny_dir(family)
    ref = _reference(folder)
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False)[0, len(PROMPT):].tolist()
    draft_dir = noisy_copy(folder, tmp_path / "draft")
    on_host = 0
    for policy in sorted(POLICIES):
        window = 4 if drafts(policy) else 0
        target = OffloadedTarget.load(folder, _budget("min", ref), FAST_LINK, policy, step="static")
        draft = load_draft(draft_dir, device="cpu", mode="dequant-cache", step="static") if window else None
        try:
            tokens, stats = Engine(target, draft, window).generate_fresh(PROMPT, NEW)
        finally:
            target.close()
        assert tokens == expected, f"{family}, {policy}"
        assert target.graphed is not None and all(p.inside for p in target.graphed.pieces.values())
        assert stats.misses > 0
        on_host += stats.extra.get("host_experts", 0)
    assert on_host > 0  # some policy computed experts on the host, into the slot graphs' pair outputs


@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_a_resident_step_in_one_piece_gives_way_to_the_cut_one_while_an_expert_is_away(family, tiny_dir):
    """All experts resident, the static step runs whole (experts inside the piece a GPU captures);
    evict one between steps and the steps are cut at each layer again (there the layer reads its
    routing and fetches what is away) until a step routes to it and fetches it, then whole again:
    transformers' tokens throughout."""
    folder = tiny_dir(family)
    ref = _reference(folder)
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False)[0, len(PROMPT):].tolist()
    target = OffloadedTarget.load(folder, SlotConfig(fraction=1.0), FAST_LINK, step="static")
    graphed, pool = target.graphed, target.offload.pool
    assert graphed is not None
    away = (min(key[0] for key in pool.where), 0)
    runs: list[tuple[bool, bool]] = []  # per step after the first: (the expert in its slot, the step ran whole)
    resident = graphed._resident

    def spy() -> tuple[tuple[int, ...], ...] | None:  # GraphedStep asks once a step
        slots = resident()
        runs.append((away in pool.where and away not in pool.loading, slots is not None))
        return slots

    def between_steps(tokens: list[int]) -> None:
        if len(runs) >= 3 and all(held for held, _ in runs):
            pool.evict(away)

    graphed._resident = spy  # type: ignore[method-assign]
    try:
        tokens, _ = Engine(target).generate(PROMPT, NEW, on_tokens=between_steps)
    finally:
        target.close()
    assert tokens == expected, family
    assert len(runs) == NEW - 1  # (the first token is the prompt's)
    assert all(held == whole for held, whole in runs)  # whole exactly while every expert is in its slot
    assert runs[:3] == [(True, True)] * 3 and (False, False) in runs
    assert graphed.whole[1].calls + graphed.pieces[1].calls == NEW - 1


def test_a_step_mode_the_target_cannot_take_is_refused_by_name(tiny_dir):
    folder = tiny_dir("mixtral")
    with pytest.raises(ValueError, match="step: expected one of"):
        OffloadedTarget.load(folder, SlotConfig(fraction=0.5), FAST_LINK, step="compiled")
    with pytest.raises(ValueError, match="step: 'graph' needs a CUDA device"):
        OffloadedTarget.load(folder, SlotConfig(fraction=0.5), FAST_LINK, step="graph")
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), FAST_LINK)
    try:
        assert target.step_mode == "eager" and target.graphed is None  # auto on a CPU
    finally:
        target.close()
