"""Engine exactness: speculative output is token-identical to target-only greedy decoding
for every policy and budget, at batch 1 and 16, with and without an installed cost table.

The tiny target runs in float64, so its greedy choices have margins far above the numeric
difference between batch shapes and identity is exact here. Most runs use an oracle draft
(the true continuation, corrupted at random positions) so that drafts are really accepted,
often partly: a random draft almost never proposes an accepted token and would leave the
accept/commit path untested."""

from __future__ import annotations

import pytest

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from engine_support import OracleDraft, greedy_references, random_prompts, synthetic_table, tiny_pair

MAX_TOKENS = 24
BUCKETS = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, seed=5)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def target_only_steps(models, prompts):
    """Decode steps target-only decoding takes for the batch-16 workload, with and without overlap."""
    return {overlap: run(models[0], None, prompts, 5, "none", batch=16, overlap=overlap)[0].counters.steps
            for overlap in (False, True)}


def oracle(draft, prompts, references, seed=0, corrupt=0.25):
    return OracleDraft(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=seed, corrupt=corrupt)


def run(target, draft, prompts, width, policy, options=None, *, batch=16, table=None, overlap=False):
    config = EngineConfig(draft_width=width, policy=policy, policy_options=options or {},
                          request_buckets=tuple(b for b in BUCKETS if b <= batch), max_model_len=160,
                          schedule_overlap=overlap)
    engine = Engine(target, draft, config)
    if table is not None:
        engine.install_table(table)
    if isinstance(draft, OracleDraft):
        draft.engine = engine
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    return engine, outputs


POLICIES = [("none", {}), ("adaptive", {})] + [("fixed", {"k": k}) for k in range(0, 8)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("policy,options", POLICIES, ids=lambda v: str(v))
def test_every_policy_is_exact_with_partly_accepted_drafts(models, prompts, references, policy, options, batch,
                                                            overlap):
    target, draft = models
    engine, outputs = run(target, oracle(draft, prompts, references, seed=batch, corrupt=0.4), prompts, 7, policy,
                          options, batch=batch, table=synthetic_table(7, BUCKETS), overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    assert engine.counters.committed_tokens == MAX_TOKENS * len(prompts)
    accepted = sum(o.accepted_length for o in outputs) / len(outputs)
    if policy == "none" or options.get("k") == 0:
        assert accepted == 1.0
    else:  # drafts were accepted, and not all of them: full and partial acceptance both ran
        assert accepted > 1.4
        assert any(o.acceptance < 1.0 for o in outputs)


@pytest.mark.parametrize("static", [False, True], ids=["no-backend", "static-backend"])
@pytest.mark.parametrize("policy,options", [("none", {}), ("fixed", {"k": 2}), ("adaptive", {})], ids=str)
def test_an_eager_verify_forwards_the_live_rows_only(models, prompts, references, policy, options, static, monkeypatch):
    """Three requests in bucket 4: a tier's padding rows (the empty entry's and the unspent ones) would
    be a quarter or more of every forward; an eager step (no graph backend, or the CPU's static one,
    whose warmup runs every key on an empty bucket) leaves them out, and the output stays exact."""
    from dspark_plugins.graphs.static import EagerStaticBackend

    target, draft = models
    batches = []
    real_forward = target.forward

    def recording_forward(batch, cache, *args, **kwargs):
        batches.append(batch)
        return real_forward(batch, cache, *args, **kwargs)

    monkeypatch.setattr(target, "forward", recording_forward)
    drafting = oracle(draft, prompts[:3], references[:3])
    engine = Engine(target, drafting, EngineConfig(draft_width=3, policy=policy, policy_options=options,
                                                   request_buckets=(1, 2, 4), max_model_len=160),
                    graphs=EagerStaticBackend("cpu") if static else None)
    drafting.engine = engine
    engine.warmup()
    engine.install_table(synthetic_table(3, (1, 2, 4)))
    engine.mark_ready()
    batches.clear()  # (a warmup on empty buckets forwards padding rows only)
    outputs = engine.generate(prompts[:3], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == references[:3]
    scratch = engine.runner.scratch_slot
    steps = [b for b in batches if scratch in b.slot_ids.tolist()]  # verify steps (a bucket entry was empty)
    assert steps, "no step of three requests in bucket 4 ran"
    for batch in steps:
        rows = batch.row_offsets.diff().tolist()
        assert batch.tokens.shape[0] == batch.row_offsets[-1] == sum(rows)
        assert all(n == 0 for n, slot in zip(rows, batch.slot_ids.tolist()) if slot == scratch), rows


@pytest.mark.parametrize("policy,options", [("adaptive", {}), ("fixed", {"k": 3})], ids=str)
def test_matmul_attention_is_exact(models, prompts, references, policy, options):
    # the attention form CUDA decode and verify steps take (attention.matmul_attention), run here on the CPU
    from dspark_core.models.attention import set_attention_kernel

    target, draft = models
    set_attention_kernel("matmul")
    try:
        engine, outputs = run(target, oracle(draft, prompts, references, seed=7, corrupt=0.4), prompts, 7, policy,
                              options, table=synthetic_table(7, BUCKETS), overlap=True)
    finally:
        set_attention_kernel("auto")
    assert [list(o.token_ids) for o in outputs] == references
    assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.4


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy,options", [("adaptive", {}), ("fixed", {})], ids=str)
def test_random_draft_is_exact(models, prompts, references, policy, options, overlap):
    target, draft = models
    engine, outputs = run(target, draft, prompts, 7, policy, options, table=synthetic_table(7, BUCKETS),
                          overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    assert engine.counters.committed_tokens == MAX_TOKENS * len(prompts)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("width", [5, 7])
@pytest.mark.parametrize("policy,options", [("adaptive", {}), ("adaptive", {"tier_lag": 2}), ("fixed", {"k": 2}),
                                            ("fixed", {}), ("none", {})], ids=str)
def test_accepting_draft_is_exact_and_accepts(models, prompts, references, target_only_steps, policy, options, width,
                                              overlap):
    target, draft = models
    engine, outputs = run(target, oracle(draft, prompts, references, seed=width), prompts, width, policy, options,
                          table=synthetic_table(width, BUCKETS), overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    if policy != "none" and options.get("k", 1) > 0:
        # the accept path really ran: several tokens per step on average, and clearly fewer
        # steps than target-only decoding needs for the same work (about 0.35-0.6 of them)
        assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.5
        assert engine.counters.steps < 0.75 * target_only_steps[overlap]
    widths = {w for o in outputs for w in o.verify_widths}
    if policy == "adaptive":
        assert len(widths) > 1  # the budget actually varies with confidence
        assert engine.counters.fallback_steps == 0


def full_width_schedule(max_tokens, width, accepts_all):
    """Verify widths of one request at full width (capped by what is left to generate), when every
    drafted token is accepted or none is; the prefill commits the first token."""
    widths, produced = [], 1
    while produced < max_tokens:
        widths.append(min(width, max_tokens - produced - 1))
        produced += (widths[-1] if accepts_all else 0) + 1
    return widths


@pytest.mark.parametrize("corrupt", [0.0, 1.0], ids=["all-accepted", "none-accepted"])
def test_without_table_adaptive_falls_back_to_full_width(models, prompts, references, corrupt):
    target, draft = models
    engine, outputs = run(target, oracle(draft, prompts[:4], references[:4], corrupt=corrupt), prompts[:4], 5,
                          "adaptive", batch=4)
    assert [list(o.token_ids) for o in outputs] == references[:4]
    assert engine.counters.fallback_steps == engine.counters.steps > 0
    expected = full_width_schedule(MAX_TOKENS, 5, accepts_all=corrupt == 0.0)
    assert expected == ([5, 5, 5, 4] if corrupt == 0.0 else [5] * 18 + [4, 3, 2, 1, 0])
    assert all(list(o.verify_widths) == expected for o in outputs)


def test_stops_at_eos_and_max_tokens(models, prompts, references):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2)))
    # pretend the 5th generated token of the first reference is EOS
    eos = references[0][4]
    engine.stops.eos_ids = (eos,)
    out = engine.generate([prompts[0], prompts[1]], [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=3)])
    cut = references[0].index(eos)
    assert list(out[0].token_ids) == references[0][:cut] and out[0].finish_reason == "stop"
    assert list(out[1].token_ids) == references[1][:3] and out[1].finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_requests_join_and_leave_between_steps(models, prompts, references, overlap):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2, 4),
                                                schedule_overlap=overlap))
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.step()
    late = engine.add_request(prompts[1], SamplingParams(max_tokens=5, ignore_eos=True))
    done = {}
    while len(done) < 2:
        done.update({o.request_id: o for o in engine.step()})
    assert list(done[first.request_id].token_ids) == references[0]
    assert list(done[late.request_id].token_ids) == references[1][:5]
    assert engine.storage.free_slots == 4
    engine.close()


def test_more_prompts_than_slots_queue(models, prompts, references):
    target, draft = models
    engine, outputs = run(target, draft, prompts, 5, "fixed", {"k": 3}, batch=2)
    assert [list(o.token_ids) for o in outputs] == references


def test_bad_requests_are_clear_errors(models):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, request_buckets=(1,), max_model_len=64))
    with pytest.raises(ConfigError, match="prompt: must not be empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="exceeds max_model_len 64"):
        engine.add_request([1] * 40, SamplingParams(max_tokens=30))
    with pytest.raises(ConfigError, match="cost table is for draft_width 7"):
        engine.install_table(synthetic_table(7, (1,)))


def test_policy_with_draft_needs_a_draft(models):
    with pytest.raises(ConfigError, match="needs a draft model"):
        Engine(models[0], None, EngineConfig(policy="adaptive"))
    Engine(models[0], None, EngineConfig(policy="none"))  # target-only needs none


def test_width_above_draft_block_is_refused(models):
    target, _ = models
    _, small = tiny_pair(seed=3, block_size=4)
    with pytest.raises(ConfigError, match="proposes at most 4 tokens"):
        Engine(target, small, EngineConfig(draft_width=5))


def test_observers_see_every_decode_step(models, prompts):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", policy_options={"k": 2},
                                                request_buckets=(1, 2, 4)))
    reports = []
    engine.add_observer(reports.append)
    engine.generate(prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(reports) == engine.counters.steps
    assert all(r.request_bucket == 4 and r.target_rows == 4 + sum(r.verify_lengths) for r in reports)
    assert max(max(r.verify_lengths) for r in reports) == 2
    # every decode step's committed tokens add up to the output, less the token each prefill made
    assert sum(r.committed_tokens for r in reports) == 3 * (6 - 1)


def test_cancel_frees_the_slot_and_keeps_finished_reasons(models, prompts):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2)))
    done = engine.add_request(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
    live = engine.add_request(prompts[1], SamplingParams(max_tokens=50, ignore_eos=True))
    while done.finish_reason is None:
        engine.step()
    assert engine.has_work
    engine.cancel(done)
    assert done.finish_reason == "length"
    engine.cancel(live)
    while engine.has_work:
        engine.step()
    assert live.finish_reason == "cancelled" and engine.storage.free_slots == 2


def test_an_eos_past_max_tokens_ends_the_request_for_length():
    from dspark_core.engine.request import Request
    from dspark_core.engine.stops import StopChecker

    stops = StopChecker(eos_ids=[0], tokenizer=None)
    cut = Request(prompt=[5, 6], params=SamplingParams(max_tokens=2))
    # a step launched before the last results were in committed three tokens; only two were asked for
    assert stops.append(cut, [7, 8, 0]) == "length" and cut.output == [7, 8]
    inside = Request(prompt=[5, 6], params=SamplingParams(max_tokens=3))
    assert stops.append(inside, [7, 0, 8]) == "stop" and inside.output == [7]
    last = Request(prompt=[5, 6], params=SamplingParams(max_tokens=2))
    assert stops.append(last, [7, 0]) == "stop" and last.output == [7]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_finish_reasons_match_target_only_decoding_around_an_eos(models, prompts, references, overlap):
    # the EOS sits at some position; for every max_tokens around it a drafting engine (which commits
    # several tokens a step, possibly past max_tokens under overlap) must end like target-only decoding
    target, draft = models
    eos = references[0][4]
    cut = references[0].index(eos)
    # an oracle draft proposes the reference itself, so a step commits up to six tokens at once
    sure = oracle(draft, prompts[:1], references[:1], corrupt=0.0)
    engines = {policy: Engine(target, sure if policy == "fixed" else draft,
                              EngineConfig(draft_width=5, policy=policy, request_buckets=(1, 2),
                                           schedule_overlap=overlap))
               for policy in ("none", "fixed")}
    sure.engine = engines["fixed"]
    for engine in engines.values():
        engine.stops.eos_ids = (eos,)
    for max_tokens in range(1, cut + 4):
        ends = {policy: engine.generate([prompts[0]], SamplingParams(max_tokens=max_tokens))[0]
                for policy, engine in engines.items()}
        want = ("length", references[0][:max_tokens]) if max_tokens <= cut else ("stop", references[0][:cut])
        for policy, out in ends.items():
            assert (out.finish_reason, list(out.token_ids)) == want, (policy, max_tokens)
    for engine in engines.values():
        engine.close()


class LetterTokenizer:
    """Token i decodes to the letter ``chr(97 + i % 26)``: enough text to place stop strings."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("chunks", [[[0], [1], [2], [3], [4], [5]], [[0], [1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]],
                         ids=["one-at-a-time", "one-chunk", "two-chunks"])
def test_a_stop_string_ends_the_output_at_the_token_that_completed_it(chunks):
    # "abcdef": the stop "cd" is complete after the 4th token; however the tokens arrive, the request
    # keeps exactly four and its text ends before the stop string
    from dspark_core.engine.request import Request
    from dspark_core.engine.stops import StopChecker

    stops = StopChecker(eos_ids=[99], tokenizer=LetterTokenizer())
    request = Request(prompt=[7], params=SamplingParams(max_tokens=10, stop=["zz", "cd"]))
    reasons = []
    for chunk in chunks:  # the engine stops handing a request tokens once it finished
        reasons.append(stops.append(request, list(chunk)))
        if reasons[-1] is not None:
            break
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
    assert request.output == [0, 1, 2, 3] and request.text == "ab"


def test_steps_leave_room_for_tokens_still_in_flight(models, prompts, references):
    # Without overlap a decode step is built right after its request's prefill was launched, before
    # the prefill's token is appended: the caps must count that token, or a draft the target accepts
    # in full commits one token past max_tokens (cut afterwards, but verified for nothing)
    target, draft = models
    sure = oracle(draft, prompts[:1], references[:1], corrupt=0.0)
    engine = Engine(target, sure, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2),
                                               schedule_overlap=False))
    sure.engine = engine
    reports = []
    engine.add_observer(reports.append)
    for max_tokens in (1, 2, 3, 6, 7, 12):
        reports.clear()
        out = engine.generate([prompts[0]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
        assert list(out.token_ids) == references[0][:max_tokens]
        # the prefill commits one token, each decode step its accepted drafts and a bonus token
        assert 1 + sum(sum(a + 1 for a in r.accepted) for r in reports) == max_tokens, max_tokens
    engine.close()


def _tiny_engine(target, draft, config: EngineConfig, *, captured: bool) -> Engine:
    """An engine on the captured-backend stand-in (warmed up and sealed), or eager."""
    from capture_support import StandInCapturedBackend

    engine = Engine(target, draft, config, graphs=StandInCapturedBackend("cpu") if captured else None)
    if captured:
        engine.warmup()
        engine.mark_ready()
    return engine


def _generate(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy token ids of ``prompts``; the engine is closed afterwards."""
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        engine.close()
    return [list(o.token_ids) for o in outputs]


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_an_engine_without_drafted_tokens_decodes_target_only(captured):
    """``--num_speculative_tokens=0`` without a draft: every step verifies its anchor alone (the accept
    kernel has no drafted column to take a minimum over)."""
    target, _ = tiny_pair()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    engine = _tiny_engine(target, None, EngineConfig(draft_width=0, policy="none", request_buckets=(1, 2),
                                                      max_model_len=97), captured=captured)
    assert _generate(engine, prompts, 9) == greedy_references(target, prompts, 9)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("policy", ["none", "fixed", "adaptive"])
def test_the_forward_cuda_runs_is_exact_on_the_cpu(policy, captured):
    """The forms a CUDA forward takes (matmul attention, the residual added inside the output products),
    forced on here, eager and on the captured-backend stand-in (one-row cells, in-place reads): greedy
    output equals target-only greedy decoding."""
    from dspark_core.models.attention import set_attention_kernel
    from dspark_core.models.layers import set_residual_product

    target, draft = tiny_pair(block_size=7)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [3]]
    references = greedy_references(target, prompts, 12)
    set_attention_kernel("matmul")
    set_residual_product("fused")
    try:
        engine = _tiny_engine(target, draft if policy != "none" else None,
                              EngineConfig(draft_width=7, policy=policy, request_buckets=(1, 4), max_model_len=97),
                              captured=captured)
        outputs = _generate(engine, prompts, 12)
    finally:
        set_attention_kernel("auto")
        set_residual_product("auto")
    assert outputs == references


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_cache_shorter_than_the_widest_step_still_holds_its_padding(captured):
    """16 requests of K + 1 = 8 rows make a 128-row step, more than a 97-position cache: the padding
    rows (scratch slot, all at position 0) fit it. Found by fuzzing when they sat at positions 0, 1, ...:
    warmup failed with an IndexError, and a wide step with one live request with a ModelError."""
    target, draft = tiny_pair(block_size=7)
    engine = _tiny_engine(target, draft, EngineConfig(draft_width=7, policy="adaptive", request_buckets=(16,),
                                                      max_model_len=97), captured=captured)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    # adaptive without a table verifies full width: the widest tier, with 14 empty bucket entries
    assert _generate(engine, prompts, 20) == greedy_references(target, prompts, 20)


class _LivePacker:
    """A plugin-style policy that sizes the tier for the live requests only (one anchor each), so with
    one live request in a bucket of 4 it wants 1 + 7 rows and gets the 8-row tier: 4 rows past the
    bucket's anchors, fewer than the 7 its split asks for."""

    name, uses_draft, tier_lag = "live-packer", True, 0

    def choose_tier(self, ctx, confidences, caps):
        from dspark_core.policy import TierChoice, smallest_tier

        live = caps >= 0
        return TierChoice(rows=smallest_tier(ctx, int(live.sum() + caps[live].clip(max=ctx.draft_width).sum())))

    def split(self, kernels, confidences, caps, choice, request_bucket):
        return caps.clamp(max=confidences.shape[1]).long()


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_split_longer_than_the_tier_has_room_for_is_cut_and_stays_exact(captured):
    """No request verifies more than G - B drafted tokens in a G-row tier of bucket B (the bound a
    captured forward sizes attention by); a plugin split asking for more is cut to it, not trusted."""
    target, draft = tiny_pair(block_size=7)
    engine = _tiny_engine(target, draft, EngineConfig(draft_width=7, policy="fixed", request_buckets=(4,),
                                                      max_model_len=97), captured=captured)
    engine.set_policy(_LivePacker())
    prompts = [[5, 6, 7, 8]]
    assert _generate(engine, prompts, 16) == greedy_references(target, prompts, 16)


@pytest.mark.parametrize("policy", ["adaptive", "fixed", "none"])
def test_captured_verify_sizes_attention_for_the_rows_a_request_can_have(policy, monkeypatch):
    """A captured verify forward cannot read how many rows each request has: it is told that a live
    request has at most min(K, G - B) + 1 (its anchor and the drafted rows a G-row tier of B requests
    has room for), so a 32-row tier of 4 requests pads attention to 8 rows per request, not 32, the
    bucket's own tier to one row, and the output stays exact."""
    from dspark_core.graphs import static_shapes_active
    from dspark_core.models.row_layout import RowLayout
    from dspark_core.models.row_cells import OneRowCells

    widths = set()

    def recording(constructor):
        def recorded(cls, *args, **kwargs):
            layout = constructor(*args, **kwargs)
            if static_shapes_active():
                widths.add(int(getattr(layout, "layout", layout).pad_index.shape[1]))
            return layout

        return classmethod(recorded)

    # the bucket's five cache slots (four and the scratch one) are read in place: static_window;
    # the bucket's own tier (one row per request) computes its rows in cells: OneRowCells
    monkeypatch.setattr(RowLayout, "build", recording(RowLayout.build))
    monkeypatch.setattr(RowLayout, "static_window", recording(RowLayout.static_window))
    monkeypatch.setattr(OneRowCells, "build", recording(OneRowCells.build))
    target, draft = tiny_pair(block_size=7)
    engine = _tiny_engine(target, draft if policy != "none" else None,
                          EngineConfig(draft_width=7, policy=policy, request_buckets=(4,), max_model_len=97), captured=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    outputs = _generate(engine, prompts, 12)
    assert widths == set(range(1, 9))  # tiers of 4-32 rows: min(K, G - 4) + 1 rows per request
    assert outputs == greedy_references(target, prompts, 12)
