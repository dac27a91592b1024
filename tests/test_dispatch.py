"""Dispatch counted (ops reaching a kernel, reads of device data) and charged by the as-built clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.draft.quantize.model import quantize_model
from specter.engine import Engine
from specter.eval.synthetic import build_held_out
from specter.models.decode import LeanStep, _rms
from specter.target import OffloadedTarget
from specter.timing.clock import VirtualClock, make_clock
from specter.timing.costs import resolve_timing
from specter.timing.dispatch import (
    READS,
    Dispatch,
    DispatchCount,
    defer_read,
    drop_deferred,
    flush_reads,
    host_read,
    once_per_step,
    replay,
)

FAST = LinkConfig(kind="sim", bandwidth=1e12, latency=0.0)
PROMPT = list(range(3, 11))


def test_views_and_allocations_are_not_ops_and_every_read_is_counted():
    x = torch.randn(4, 8)
    before = READS.count
    with DispatchCount() as counted:
        y = x.view(8, 4).t()[1:]  # views
        torch.empty(3)  # an allocation, no kernel
        z = y + 1  # one op
        z.sum().item()  # one op (sum), one read
        x.tolist()  # a read that bypasses host_read still shows
        host_read(z[0])
    assert counted.ops == 2 and counted.by_name == {"add": 1, "sum": 1}
    assert counted.reads == 3
    assert READS.count - before == 1  # host_read's own tally: the engine's per-request figure


@pytest.mark.parametrize("inference", [False, True])
def test_a_dtype_change_is_a_kernel_inside_inference_mode_too(inference):
    """Under ``torch.inference_mode`` (every engine step) a dtype change reaches the counter as
    ``aten.to``, whose schema may alias its input; it is still a kernel where it makes a new tensor
    (bf16 → fp32 and back: an RMSNorm's two conversions on a GPU), and nothing where it changes
    nothing, as views and a reshape of contiguous rows are nothing."""
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with torch.inference_mode(inference), DispatchCount() as counted:
        wide = x.to(torch.float32)  # a kernel
        narrow = wide.to(x.dtype)  # a kernel
        x.to(torch.bfloat16), x.view(6, 8), x.reshape(48), x.contiguous()  # the input itself, or views of it
        x.transpose(1, 2).contiguous()  # a copy: a kernel
    assert counted.kernels == counted.ops == 3, counted.by_name
    assert torch.equal(narrow, x)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])  # (the tiny qwen2_moe's biases keep its router unfused)
def test_a_bf16_layers_norms_and_routing_weights_convert_no_dtypes_and_are_transformers(family, tiny_dir):
    """A GPU's step computes in bf16. An RMSNorm's fp32 part took a conversion in and one out, and the
    routing weights one more (five kernels a layer, as many as its attention's matmuls); the norm's own
    kernel rounds its output now and a renormalizing router's division writes the model's dtype. Both stay
    transformers' modules bit for bit: the norm, and the router's weights cast as its experts take them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir(family), experts_implementation="eager",
                                                 dtype=torch.bfloat16).eval()
    lean = LeanStep.for_model(model, family, fused=True)
    assert lean is not None and lean.fused is not None
    layer = model.model.layers[0]
    torch.manual_seed(0)
    x = torch.randn(1, 5, model.config.hidden_size).to(torch.bfloat16) * 4
    with torch.inference_mode():
        with DispatchCount() as counted:
            normed = _rms(layer.post_attention_layernorm, x)
            _, ids, weights, _ = lean.fused[0].route(normed)
        want = layer.post_attention_layernorm(x)
        _, want_weights, want_ids = layer.mlp.gate(want.view(5, -1))
    # a router that renormalizes converts in its division; one that does not (qwen's default) chooses in fp32
    # and casts what it chose
    conversions = counted.by_name.get("to", 0) + counted.by_name.get("_to_copy", 0)
    assert conversions == (0 if lean.fused[0].normalize else 1), counted.by_name
    assert torch.equal(normed, want)
    assert torch.equal(ids, want_ids) and weights.dtype == torch.bfloat16
    assert torch.equal(weights, want_weights.to(torch.bfloat16))


def test_a_graphed_steps_rotation_is_two_gathers_from_a_table_that_is_the_rotary_module(tiny_dir):
    """The pieces a GPU replays take the step's positions on the device, so they cannot slice a table on
    the host; the rotary module there issued some fifteen kernels a step. Now two kernels: a gather from a
    table that covers the cache (remade larger when it grows) and a ``where`` for the value heads. Each
    query and key head's row is transformers' rotary module at those positions, ``[cos | sin with its
    first half negated]`` (the fused step's roll); each value head's ``[1 | 0]``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2_moe"), experts_implementation="eager").eval()
    lean = LeanStep.for_model(model, "qwen2_moe", fused=True)
    assert lean is not None and lean.fused is not None
    rotated, kept = lean.fused[0].q_heads + lean.fused[0].kv_heads, lean.fused[0].kv_heads
    like = model.model.embed_tokens.weight
    with torch.inference_mode():
        for capacity, positions in ((256, [0, 7, 255]), (512, [3, 300, 511])):
            at = torch.tensor(positions)
            lean.turn_at(at, capacity, like)  # the table, made (or remade) once
            with DispatchCount() as counted:
                turn = lean.turn_at(at, capacity, like)
            assert counted.kernels == 2, counted.by_name
            want_cos, want_sin = model.model.rotary_emb(like, at[None])
            half = want_sin.shape[-1] // 2
            signed = torch.cat((-want_sin[0, :, :half], want_sin[0, :, half:]), dim=-1)
            assert turn.shape == (rotated + kept, len(positions), 4 * half)
            for head in range(rotated):
                assert torch.equal(turn[head], torch.cat((want_cos[0], signed), dim=-1))
            ones = torch.cat((torch.ones(2 * half), torch.zeros(2 * half)))
            assert torch.equal(turn[rotated:], ones.expand(kept, len(positions), -1))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_graphed_attention_rotates_all_heads_at_once_and_writes_keys_and_values_in_one_copy(tiny_dir, family, dtype):
    """A graphed piece's attention rotates q and k as transformers' ``apply_rotary_pos_emb`` does, bit for
    bit (each product rounded, then the sum), in three kernels where the roll, two products and a sum were
    four, with the value heads passed through unchanged, and writes the new keys and values to the cache
    in one copy where it took two: the keys in the cache are transformers' rotated keys, the values its
    values, both bit for bit."""
    from transformers.models.mixtral.modeling_mixtral import apply_rotary_pos_emb

    from specter.models.graphed import StaticKV

    model = AutoModelForCausalLM.from_pretrained(tiny_dir(family), experts_implementation="eager",
                                                 dtype=dtype).eval()
    lean = LeanStep.for_model(model, family, fused=True)
    assert lean is not None and lean.fused is not None
    attention, fused = model.model.layers[0].self_attn, lean.fused[0]
    cache = StaticKV.for_model(model, capacity=16)
    tokens, dim = 3, attention.head_dim
    positions = torch.tensor([5, 6, 7])
    cache.write_at = positions
    x = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = torch.zeros(fused.q_heads // fused.kv_heads * tokens, 16, dtype=dtype)
    with torch.inference_mode():
        turn = lean.turn_at(positions, cache.capacity, x)
        fused.static_attention(attention, x, turn, mask, cache, x.clone())  # the gather's index, made once
        with DispatchCount() as counted:
            fused.static_attention(attention, x, turn, mask, cache, x.clone())
        shape = (1, tokens, -1, dim)
        q = attention.q_proj(x).view(shape).transpose(1, 2)
        k = attention.k_proj(x).view(shape).transpose(1, 2)
        v = attention.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attention, "q_norm"):
            q = attention.q_norm(q.transpose(1, 2)).transpose(1, 2)
            k = attention.k_norm(k.transpose(1, 2)).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, positions[None])
        _, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = cache.keys_values(0)
    # the fused projection is one matmul where transformers runs three: equal to rounding there
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(keys[:, :, 5:8], want_k, **tol)
    torch.testing.assert_close(values[:, :, 5:8], v, **tol)
    names = counted.by_name
    assert names.get("roll", 0) == 0 and names.get("index_copy", 0) + names.get("index_copy_", 0) == 1, names
    # bit for bit from the fused projection's own output: the rotation and the copy add no rounding
    with torch.inference_mode():
        qkv = torch.nn.functional.linear(x, *fused.qkv).view(shape)
        split = fused.q_heads + fused.kv_heads
        qk = qkv[:, :, :split]
        if fused.qk_norm is not None:
            from specter.models.decode import _rms_weight
            qk = _rms_weight(qk, *fused.qk_norm)
        qk = qk.transpose(1, 2)
        _, want_k = apply_rotary_pos_emb(qk[:, : fused.q_heads], qk[:, fused.q_heads :], cos, sin)
    assert torch.equal(keys[:, :, 5:8], want_k)
    assert torch.equal(values[:, :, 5:8], qkv[:, :, split:].transpose(1, 2))


def _resident_decoding(model: Path) -> dict[str, tuple[list[int], list[DispatchCount], int]]:
    """Plain decoding of ``PROMPT`` all resident, eager and static (every token count prepared): per step
    mode, the tokens of a 10-token run, the counters of a 2- and a 10-token run (their difference is 8
    decode steps) and the MoE layers."""
    runs = {}
    for step in ("eager", "static"):
        target = OffloadedTarget.load(model, SlotConfig(fraction=1.0), FAST, "demand-lru", step=step)
        try:
            engine = Engine(target)
            engine.prepare_steps()
            engine.generate_fresh(PROMPT, 4)
            counters = []
            for new in (2, 10):
                with DispatchCount() as counted:
                    tokens, _ = engine.generate_fresh(PROMPT, new)
                counters.append(counted)
            runs[step] = (tokens, counters, len(target.loaded.moe_layers))
        finally:
            target.close()
    return runs


def test_a_graphed_step_moves_its_own_position_on_and_the_host_sets_it_only_after_a_prompt(held_out):
    """Before each step the host wrote the cache's position into the device (a fill, outside the graph:
    on a GPU a launch the device waits behind, after the step's sync). Each step now moves the position
    on inside its graph; the host writes it only where it moved the length itself (the prompt, a crop).
    Eight plain steps more issue no fill, and the tokens stay the eager step's."""
    runs = _resident_decoding(held_out[0])
    fills = [counted.by_name.get("fill_", 0) for counted in runs["static"][1]]
    assert fills[1] - fills[0] == 0, fills
    assert runs["static"][0] == runs["eager"][0]


def test_each_warm_up_writes_from_the_cache_length_not_from_where_the_last_one_left_the_position(tmp_path):
    """Steps move the device's position on themselves, warm-ups too: seventeen token counts made ready
    one after another after a 150-token prompt would have walked it 153 positions past the length, out
    of the cache's 256 (an index error in the rotation's gather). Each warm-up starts from the length;
    the steps after are the eager step's."""
    model = build_held_out(tmp_path / "model")
    prompt = [3 + i % 250 for i in range(150)]
    tokens = {}
    for step in ("eager", "static"):
        target = OffloadedTarget.load(model, SlotConfig(fraction=1.0), FAST, "demand-lru", step=step)
        try:
            cache = target.new_cache()
            logits = target.forward(torch.tensor([prompt]), cache)
            if target.graphed is not None:
                assert target.graphed.prepare(range(1, 18)) == 17
                assert target.graphed.cache.capacity == 256
            made = []
            for _ in range(6):
                made.append(int(logits[0, -1].argmax()))
                logits = target.forward(torch.tensor([[made[-1]]]), cache)
            tokens[step] = made
        finally:
            target.close()
    assert tokens["static"] == tokens["eager"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tokens_moe_input_is_the_norm_written_once_per_pair(tiny_dir, family, dtype):
    """For one token whose experts run on a runner that takes pair rows, the MoE block's input is the
    post-attention norm written k times by the norm's own kernels: each row is transformers' RMSNorm
    module's output for the token, bit for bit, and the router's input is the first row. Several tokens,
    or a runner that does not take rows, get the norm alone."""
    from types import SimpleNamespace

    model = AutoModelForCausalLM.from_pretrained(tiny_dir(family), experts_implementation="eager",
                                                 dtype=dtype).eval()
    lean = LeanStep.for_model(model, family, fused=True)
    assert lean is not None and lean.fused is not None
    index = next(i for i, f in enumerate(lean.fused) if f.routed)  # qwen2_moe's tiny model starts dense
    layer, fused = model.model.layers[index], lean.fused[index]
    norm, experts = layer.post_attention_layernorm, layer.mlp.experts
    generator = torch.Generator().manual_seed(5)
    one = torch.randn(1, 1, model.config.hidden_size, generator=generator).to(dtype)
    three = torch.randn(1, 3, model.config.hidden_size, generator=generator).to(dtype)
    with torch.inference_mode():
        assert fused.moe_input(layer.mlp, norm, one)[1] is None  # transformers' own experts: no runner
        experts.__dict__["_specter_runner"] = SimpleNamespace(takes_rows=True)
        try:
            with DispatchCount() as counted:
                x, rows = fused.moe_input(layer.mlp, norm, one)
            _, none = fused.moe_input(layer.mlp, norm, three)
            want = norm(one)
        finally:
            del experts.__dict__["_specter_runner"]
    assert none is None and rows is not None and rows.shape == (fused.top_k, model.config.hidden_size)
    assert rows.is_contiguous() and counted.kernels == 2, counted.kernels_by_name
    for row in rows:
        assert torch.equal(row, want[0, 0])
    assert torch.equal(x, want) and x.data_ptr() == rows.data_ptr()


def test_a_resident_graphed_step_gathers_no_slot_per_pair_and_writes_each_layers_cache_once(held_out):
    """All experts resident in the consecutive slots ``initial_slots`` lays out: the whole graphed step's
    experts run over each layer's run of the pool with no slot-map gather, so its only gather a layer is
    the rotation's; each layer writes its keys and values in one copy and rolls nothing; a one-token
    step's position is the cache's own, not a sum made for it; its experts' pair rows are the norm's
    output (``_Fused.moe_input``), not a copy of the token's row, in the eager step too. The tokens are
    the eager step's."""
    runs = _resident_decoding(held_out[0])
    _, (short, long), layers = runs["static"]
    per = {name: (n - short.kernels_by_name.get(name, 0)) / (8 * layers) for name, n in long.kernels_by_name.items()}
    # a gather a layer (the rotation's) and one a step (its rows from the table): none through a slot map
    assert per.get("index", 0) == 0 and per.get("index_select", 0) == 1 + 1 / layers, per
    assert per.get("index_copy_", 0) == 1 and per.get("roll", 0) == 0, per
    assert per.get("add", 0) == 0, per  # one token's position is the cache's own: no add for it
    for step in ("static", "eager"):
        _, (short, long), _ = runs[step]
        copies = {n: long.kernels_by_name.get(n, 0) - short.kernels_by_name.get(n, 0) for n in ("contiguous", "clone")}
        assert copies == {"contiguous": 0, "clone": 0}, (step, copies)
    assert runs["static"][0] == runs["eager"][0]


def test_implicit_syncs_are_counted():
    with DispatchCount() as counted:
        torch.arange(6).nonzero()
        torch.tensor([1, 1, 2]).unique()
    assert counted.syncs == 2


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> tuple[Path, Path]:
    """A Qwen2-MoE of 4 MoE layers x 32 experts, top-4, with a shared expert (used to tune nothing),
    and an int8 draft of it (it agrees with the target: a round's count is that of rounds that stand)."""
    folder = tmp_path_factory.mktemp("held-out")
    build_held_out(folder / "model")
    quantize_model(str(folder / "model"), str(folder / "draft"), method="int8", progress=False)
    return folder / "model", folder / "draft"


def _per_token(engine: Engine, layers: int, tokens: int = 16) -> tuple[float, float]:
    """Ops and reads per MoE layer per committed token: a run of tokens + 1 less a run of 1."""
    ops, reads, _ = _counted(engine, layers, tokens)
    return ops, reads


def _counted(engine: Engine, layers: int, tokens: int = 16) -> tuple[float, float, float]:
    """Ops, reads and grouped expert matmuls per MoE layer per committed token."""
    counts = []
    for new in (1, tokens + 1):
        engine.target.offload.reset_residency()
        with DispatchCount() as counted:
            ids, _ = engine.generate(PROMPT, new)
        counts.append((counted.ops, counted.reads, counted.by_name.get("_grouped_mm", 0), len(ids)))
    (ops1, reads1, mm1, n1), (ops2, reads2, mm2, n2) = counts
    per = (n2 - n1) * layers
    return (ops2 - ops1) / per, (reads2 - reads1) / per, (mm2 - mm1) / per


# The ops of one expert group beyond its two grouped matmuls (gather, activation, product, scatter-add):
# a layer runs its resident experts as one group and, when some arrive while it computes, those as a
# second; how many layers take a second group depends on when the copies land (real time), so the
# bounds below hold the rest of the step fixed and the groups to at most two a layer.
GROUP_OPS = 6


@pytest.mark.parametrize(("budget", "max_rest", "reads_per_layer"), [(1.0, 37, 0.25), (0.25, 33, 1 + 1 / 64)])
def test_plain_decoding_dispatches_a_few_dozen_ops_and_reads_only_where_the_host_decides(
    held_out, budget, max_rest, reads_per_layer,
):
    """Counted through the public API: at commit d141f91 plain decoding took 93 ops and 2.25 reads per MoE
    layer per token here. Now the token a step makes stays on the device and is read with the next step's
    first read (``Engine._plain``). Offloaded: one read of the routing per layer (the misses), the first
    bringing the token, and once a request the last token's own read (1/64 of a read per layer over 16
    tokens x 4 layers); all resident, one read a step, which brings the token and the layers' routing
    (``defer_read``). Offloaded, a layer's experts run as one or two groups (``GROUP_OPS``), so the ops
    besides them are bounded; in all, issue 34's target: at most 45 ops."""
    target = OffloadedTarget.load(held_out[0], SlotConfig(fraction=budget), FAST, "demand-lru", device="cpu")
    try:
        ops, reads, matmuls = _counted(Engine(target), layers=4)
        _, stats = Engine(target).generate_fresh(PROMPT, 8)
    finally:
        target.close()
    groups = matmuls / 2
    assert groups <= 2
    assert ops - GROUP_OPS * groups <= max_rest  # ~43 ops in all, ~37 / ~33 besides the expert groups
    assert ops <= 45
    assert reads == pytest.approx(reads_per_layer)
    assert stats.hits + stats.inflight + stats.misses >= 8 * 4  # the counters settled from deferred reads too
    # 8 tokens: 7 steps after the first; resident, the last step's read brings its own token too
    assert stats.extra["host_reads"] == (7 if budget == 1.0 else 4 * 7 + 1)


def test_a_deferred_read_rides_on_the_next_read_of_its_dtype():
    seen: dict[str, object] = {}
    before = READS.count
    defer_read(torch.tensor([[3, 1], [4, 1]]), lambda ids: seen.update(ids=ids))
    defer_read(torch.tensor([0.5]), lambda probs: seen.update(probs=probs))
    with DispatchCount() as counted:
        assert host_read(torch.tensor([7, 8])) == [7, 8]
    assert counted.reads == 1 and READS.count - before == 1
    assert seen["ids"].tolist() == [[3, 1], [4, 1]] and "probs" not in seen  # another dtype waits
    flush_reads()
    assert seen["probs"].tolist() == [0.5] and READS.count - before == 2
    defer_read(torch.tensor([1]), lambda ids: seen.update(late=ids))
    drop_deferred()
    flush_reads()
    assert "late" not in seen


def test_a_speculative_round_dispatches_under_sixty_ops_per_committed_token(held_out):
    """Draft and verify together, K 8, rounds that stand: at d141f91 ~445 ops and 14.5 reads per MoE layer
    per committed token here; the draft's step now reads its routing once and its experts not at all."""
    draft = load_draft(held_out[1], device="cpu", mode="dequant-cache")
    target = OffloadedTarget.load(held_out[0], SlotConfig(fraction=0.25), FAST, "specter+fixed+nopipe", device="cpu")
    try:
        ops, reads = _per_token(Engine(target, draft, window=8), layers=4, tokens=18)
    finally:
        target.close()
    assert ops <= 60
    assert reads <= 1.5


@pytest.mark.parametrize(("budget", "window", "max_ops"), [(1.0, 0, 6), (0.25, 0, 10), (0.25, 8, 16)])
def test_the_pieces_a_gpu_replays_count_one_op_each(held_out, budget, window, max_ops):
    """``step="static"`` runs on a CPU what a GPU replays as CUDA graphs (``models/graphed.py``), each piece
    counted as one launch: offloaded plain decoding ~7.5 ops per MoE layer per token where the eager lean
    step issues ~45 (a piece, the plan's copy and the slot graph for the ready experts, the same for
    each group that lands; ~15 with those experts eager); every expert resident, the whole step is one
    piece, experts inside (~3 a layer over 4 layers and a long run; ~4.3 over these 16 tokens, whose
    first step of a count runs eagerly); reads unchanged. About 40 % of the speculative round's ~13 is
    the CPU's host-computed experts (a GPU computes none on the host)."""
    draft = load_draft(held_out[1], device="cpu", mode="dequant-cache", step="static") if window else None
    policy = "specter+fixed+nopipe" if window else "demand-lru"
    target = OffloadedTarget.load(held_out[0], SlotConfig(fraction=budget), FAST, policy, device="cpu", step="static")
    try:
        ops, reads = _per_token(Engine(target, draft, window=window), layers=4, tokens=18 if window else 16)
    finally:
        target.close()
    assert ops <= max_ops
    assert reads <= (0.5 if window else 0.25 if budget == 1.0 else 1 + 1 / 64)


class _Costs:
    """A cost model of fixed charges (the clock's ``Costs`` protocol), one small layer per real one."""

    layer_scale = 1.0

    def __init__(self, dense: float = 0.0, expert: float = 0.0):
        self.dense, self.expert = dense, expert

    def dense_s(self, positions: int, context: int) -> float:
        return self.dense

    def expert_s(self, tokens: int) -> float:
        return self.expert

    def draft_s(self, routing, positions: int, context: int, compute=None) -> float:
        return 0.0

    def describe(self) -> str:
        return "fixed"


_X = torch.zeros(2)


def _ops(n: int) -> None:
    """``n`` ops that reach a kernel."""
    for _ in range(n):
        _X.add(1)


def test_a_dispatch_bound_step_takes_its_dispatch():
    """Short kernels: the device waits for the host, which issues each op in op_s (each kernel runs
    while the host issues the next ones)."""
    clock = VirtualClock(_Costs(expert=1e-6), dispatch=Dispatch("t", op_s=10e-6, read_s=0.0))
    with clock.counting():
        for _ in range(5):
            _ops(4)
            clock.charge_expert(1)
    assert clock.now() == pytest.approx(5 * 4 * 10e-6)


def test_a_compute_bound_step_takes_its_kernels_and_a_read_drains_the_device():
    """Long kernels: the host runs ahead and the device's time is the step's; a read of device data
    waits for the device to drain, then costs read_s."""
    clock = VirtualClock(_Costs(dense=1e-3), dispatch=Dispatch("t", op_s=10e-6, read_s=20e-6))
    with clock.counting():
        for _ in range(3):
            _ops(2)
            clock.charge_dense(1, 0)
        assert clock.now() == pytest.approx(3e-3)  # the host's 60 us hide under the kernels
        host_read(torch.zeros(1))
        assert clock.now() == pytest.approx(3e-3 + 20e-6)
    assert clock.dispatch_s == pytest.approx(7 * 10e-6 + 20e-6)  # torch.zeros(1) is an op too


def test_a_graphs_replay_is_one_launch_and_its_kernels_take_the_device_floor():
    """A replayed piece (``replay()``): the host pays one op for it, the device its kernels' floor."""
    clock = VirtualClock(_Costs(), dispatch=Dispatch("t", op_s=10e-6, read_s=0.0, kernel_s=3e-6))
    with clock.counting(), DispatchCount() as counted:
        with replay():
            _ops(20)
        clock.charge_expert(1)
    assert counted.ops == 1 and counted.kernels == 20 and counted.by_name == {"graph_replay": 1}
    assert clock.now() == pytest.approx(20 * 3e-6)  # the device's 60 us, not the host's 10
    eager = VirtualClock(_Costs(), dispatch=Dispatch("t", op_s=10e-6, read_s=0.0, kernel_s=3e-6))
    with eager.counting():
        _ops(20)
        eager.charge_expert(1)
    assert eager.now() == pytest.approx(20 * 10e-6)  # eager: the host's launches bound it


class _Deep(_Costs):
    layer_scale = 6.0  # each small layer stands for six real ones


def test_a_steps_own_dispatch_is_charged_once_where_a_layer_stands_for_several():
    """A layer's ops, reads and kernels are charged once per real layer; a step's own
    (``once_per_step``: embedding, LM head, the step's read; a whole step's one launch) once."""
    clock = VirtualClock(_Deep(), dispatch=Dispatch("t", op_s=10e-6, read_s=20e-6, kernel_s=1e-6))
    with clock.counting(), DispatchCount() as counted:
        _ops(4)  # a layer's
        with once_per_step:
            _ops(2)
        assert clock.now() == pytest.approx((4 * 6 + 2) * 10e-6)
        with once_per_step:
            host_read(_X)  # the step's read: one, not six
        clock.now()
        assert clock.dispatch_s == pytest.approx((4 * 6 + 2) * 10e-6 + 20e-6)
        with replay(per_step=True):  # a whole step in one graph: one launch, its layers' kernels
            _ops(5)
        clock.charge_expert(1)
    assert (counted.ops, counted.step_ops, counted.reads, counted.step_reads) == (7, 3, 1, 1)
    assert (counted.kernels, counted.step_kernels) == (11, 2)
    assert clock.dispatch_s == pytest.approx((4 * 6 + 2 + 1) * 10e-6 + 20e-6)
    # the replay's kernels, a floor each per real layer, start as its launch is issued and outlast it
    assert clock.now() == pytest.approx((4 * 6 + 2) * 10e-6 + 20e-6 + 5 * 6 * 1e-6)


def _decode_counts(folder: Path, what: str, step: str, work: Path) -> dict[str, int]:
    """What 8 tokens more cost in ops, reads and kernels, and how many of each were a step's own:
    ``plain`` decoding through the engine, a ``draft``'s one-token steps, a ``verify`` pass of 4."""
    names = ("ops", "reads", "kernels", "step_ops", "step_reads", "step_kernels")
    if what == "draft":
        quantize_model(str(folder), str(work / "draft"), method="int8", progress=False)
        draft = load_draft(work / "draft", device="cpu", mode="dequant-cache", step=step)
        cache = draft.new_cache()
        draft.forward(torch.tensor([PROMPT]), cache)
        for token in (5, 6):  # every step shape's first runs behind it
            draft.forward(torch.tensor([[token]]), cache)
        with DispatchCount() as counted:
            for token in range(8):
                draft.forward(torch.tensor([[token]]), cache)
        return {name: getattr(counted, name) for name in names}
    target = OffloadedTarget.load(folder, SlotConfig(fraction=1.0), FAST, "demand-lru", step=step)
    try:
        if what == "plain":
            engine = Engine(target)
            engine.prepare_steps()
            engine.generate_fresh(PROMPT, 4)
            runs = []
            for new in (2, 10):  # the decode of 8 tokens more: the prompt's transformers forward cancels
                with DispatchCount() as counted:
                    engine.generate_fresh(PROMPT, new)
                runs.append(counted)
            return {name: getattr(runs[1], name) - getattr(runs[0], name) for name in names}
        cache = target.new_cache()
        target.forward(torch.tensor([PROMPT]), cache)
        for _ in range(3):  # the first runs of a 4-token pass behind it
            target.forward(torch.tensor([[1, 2, 3, 4]]), cache)
            flush_reads()
        with DispatchCount() as counted:
            for _ in range(2):
                target.forward(torch.tensor([[1, 2, 3, 4]]), cache)
                with once_per_step:  # as the engine's round reads what the pass left
                    flush_reads()
        return {name: getattr(counted, name) for name in names}
    finally:
        target.close()


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("what", ["plain", "draft", "verify"])
def test_what_a_step_issues_once_does_not_grow_with_its_layers(tmp_path, what, step):
    """The ops, reads and kernels marked as a step's own are the same at two and four layers, and all
    the others exactly twice as many at four: what the as-built clock scales per layer is per layer."""
    two, four = (_decode_counts(build_held_out(tmp_path / str(n) / "model", layers=n), what, step, tmp_path / str(n))
                 for n in (2, 4))
    for name in ("ops", "reads", "kernels"):
        own = two["step_" + name]
        assert four["step_" + name] == own, name
        assert four[name] - own == 2 * (two[name] - own), name
    assert two["step_ops"] > 0 and two["step_kernels"] > 0


def test_without_counting_or_dispatch_the_virtual_clock_is_the_ideal_one():
    ideal = VirtualClock(_Costs(expert=1e-6))
    with ideal.counting():
        _ops(10)
        ideal.charge_expert(1)
    assert ideal.now() == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="dispatch"):
        make_clock("as-built", _Costs())
    with pytest.raises(ValueError, match="cost model"):
        VirtualClock(None, dispatch=Dispatch("t", 1e-6, 1e-6))
    with pytest.raises(ValueError, match="op_s"):
        Dispatch("t", -1.0, 0.0)


def test_the_as_built_clock_charges_a_requests_dispatch(held_out):
    """The same request on both clocks: the same tokens; as built it is slower by about its dispatch and
    reports it, with the reads it made."""
    runs = {}
    for clock in ("virtual", "as-built"):
        timing = resolve_timing(str(held_out[0]), clock, "qwen2moe-h200")
        target = OffloadedTarget.load(held_out[0], SlotConfig(fraction=0.25), timing.link, "demand-lru",
                                      clock=timing.make_clock())
        try:
            runs[clock] = Engine(target).generate_fresh(PROMPT, 12)
        finally:
            target.close()
    (ideal_ids, ideal), (built_ids, built) = runs["virtual"], runs["as-built"]
    assert ideal_ids == built_ids
    # a read per layer per step (the first bringing the token the step before made), and the last token's
    assert built.extra["dispatch_s"] > 0 and built.extra["host_reads"] == ideal.extra["host_reads"] == 11 * 4 + 1
    assert "dispatch_s" not in ideal.extra
    assert built.tpot_s > ideal.tpot_s
    with pytest.raises(ValueError, match="dispatch"):
        resolve_timing(str(held_out[0]), "as-built", "qwen2moe-h200", dispatch="nope")
