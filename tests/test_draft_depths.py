"""Draft depths (``--draft_depths``): at a request bucket the draft proposes only its first tokens.

What must hold: a cut block proposes what a draft trained with that block size would compute on the
same weights, with confidence 0 past the depth; greedy output stays identical to target-only
decoding for every policy; a fixed k above a bucket's depth still gets all K there; the flag is
read strictly and lands in the saved table's fingerprint; a captured step stays free of host reads.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from dspark_core.config import parse_serve_args
from dspark_core.costs.fingerprint import compare
from dspark_core.device import DeviceSpec
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError, ModelError
from dspark_core.geometry import Geometry
from dspark_core.resolve import draft_depths_for, fingerprint_for
from dspark_core.table import load_table
from capture_support import ROOT, StandInCapturedBackend, host_reads
from engine_support import DraftDouble, OracleDraft, greedy_references, random_prompts, synthetic_table, tiny_pair

WIDTH = 7
BUCKETS = (1, 2, 4, 8)
MAX_TOKENS = 20
DEPTHS = ((2, 3), (4, 2), (8, 1))  # bucket 1 proposes all K


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=5)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


def test_a_cut_block_is_the_block_of_that_size(models):
    """Depth d proposes, on the same weights and context, what the draft computes with block size d;
    the positions past it are token 0 with confidence 0, and depth K is the whole block."""
    target, draft = models
    draft.bind_target(target)
    draft.allocate_context(4, 64)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3 * 10, draft.fc.in_features, generator=generator, dtype=torch.float64)
    draft.extend_context(hidden, torch.arange(10).repeat(3), torch.arange(3).repeat_interleave(10))
    anchors, positions, slots = torch.tensor([5, 9, 17]), torch.tensor([10, 4, 7]), torch.arange(3)
    whole = draft.propose(anchors, positions, slots)
    assert all(torch.equal(a, b) for a, b in zip(draft.propose(anchors, positions, slots, depth=WIDTH), whole))
    full_config = draft.config
    for depth in (1, 2, 5):
        tokens, confidences = draft.propose(anchors, positions, slots, depth=depth)
        assert tokens.shape == confidences.shape == (3, WIDTH)
        assert tokens[:, depth:].eq(0).all() and confidences[:, depth:].eq(0).all()
        assert confidences[:, :depth].gt(0).all()
        try:  # the same draft with a block of `depth` slots (temperatures cut to match)
            draft.config = attrs.evolve(full_config, block_size=depth, sts_temperatures=None, copy_confidences=None)
            cut_tokens, cut_confidences = draft.propose(anchors, positions, slots)
        finally:
            draft.config = full_config
        assert torch.equal(tokens[:, :depth], cut_tokens)
        assert torch.allclose(confidences[:, :depth], cut_confidences, rtol=0, atol=1e-12)
    for bad in (0, WIDTH + 1):
        with pytest.raises(ModelError, match=f"draft depth {bad} is outside 1..{WIDTH}"):
            draft.propose(anchors, positions, slots, depth=bad)


def run(models, prompts, references, policy, options=None, *, depths=DEPTHS, overlap=False):
    target, draft = models
    oracle = OracleDraft(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=1, corrupt=0.3)
    engine = Engine(target, oracle, EngineConfig(draft_width=WIDTH, policy=policy, policy_options=options or {},
                                                 request_buckets=BUCKETS, max_model_len=160, schedule_overlap=overlap,
                                                 draft_depths=depths))
    oracle.engine = engine
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    reports = []
    engine.add_observer(reports.append)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == references
    return oracle, reports, outputs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy,options", [("adaptive", {}), ("adaptive", {"tier_lag": 1}), ("fixed", {"k": 1}),
                                            ("fixed", {"k": 3}), ("fixed", {})], ids=str)
def test_depths_keep_greedy_output_and_bound_what_is_verified(models, prompts, references, policy, options, overlap):
    oracle, reports, outputs = run(models, prompts, references, policy, options, overlap=overlap)
    needs = options.get("k", WIDTH) if policy == "fixed" else 0  # what a fixed k verifies per request

    def depth_at(bucket: int) -> int:  # a fixed k above the bucket's depth gets all K there
        depth = dict(DEPTHS).get(bucket, WIDTH)
        return WIDTH if needs > depth else depth

    proposed = {}
    for rows, depth in oracle.depths:  # an eager proposal has one row per live request: find its bucket
        proposed.setdefault(min(b for b in BUCKETS if b >= rows), set()).add(depth)
    assert proposed == {bucket: {depth_at(bucket)} for bucket in proposed}
    assert 8 in proposed and len(proposed) > 1  # the run met a bucket cut to one token, and another
    for report in reports:  # nothing past the depth a step proposed is ever verified
        assert max(report.verify_lengths) <= min(depth_at(report.request_bucket), needs or WIDTH)
    assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.2  # drafts were accepted


def test_a_draft_without_depths_is_refused_when_depths_are_asked(models):
    target, draft = models
    with pytest.raises(ConfigError, match=r"draft depths \{4: 2\}: this draft \(DraftDouble\) proposes only whole blocks"):
        Engine(target, DraftDouble(draft), EngineConfig(draft_width=WIDTH, request_buckets=BUCKETS, max_model_len=160,
                                                        draft_depths=((4, 2),)))
    with pytest.raises(ConfigError, match=r"draft depths \{4: 9\}: each must lie in 1..7"):
        Engine(target, draft, EngineConfig(draft_width=WIDTH, request_buckets=BUCKETS, max_model_len=160,
                                           draft_depths=((4, 9),)))
    # depths of K (nothing cut) need nothing from the draft
    Engine(target, DraftDouble(draft), EngineConfig(draft_width=WIDTH, request_buckets=BUCKETS, max_model_len=160,
                                                    draft_depths=((4, WIDTH),))).close()


def test_captured_steps_with_depths_read_only_their_results(models, prompts, references):
    """Every bucket prepares a proposal key per depth it may run (its own, and K for a fixed k above it),
    and a captured step at a cut depth still reads nothing but its result."""
    target, draft = models
    backend = StandInCapturedBackend("cpu")
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="adaptive", policy_options={"tier_lag": 2},
                                                request_buckets=BUCKETS, max_model_len=160, schedule_overlap=True,
                                                draft_depths=DEPTHS), graphs=backend)
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    engine.warmup()
    engine.mark_ready()
    proposal_depths = {}
    for key in backend.keys:
        if key.stage.startswith("propose"):
            proposal_depths.setdefault(key.request_bucket, set()).add(key.draft_depth)
    assert proposal_depths == {1: {0}, 2: {0, 3}, 4: {0, 2}, 8: {0, 1}}
    assert "depth=2" in next(k for k in backend.keys if k.draft_depth == 2).describe()
    reads: set = set()
    decode = engine.decode_on_device

    def recorded(step):
        with host_reads() as recorder:
            result = decode(step)
        reads.update(recorder.reads)
        return result

    engine.decode_on_device = recorded
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == references
    assert reads == {("cpu", "dspark_core/engine/step.py:collect"), ("numpy", "dspark_core/engine/step.py:collect")}


CPU_RULE = DeviceSpec("cpu", "cpu", "float32", "static", "gloo", default_draft_depths=((4, 4), (16, 2)))
GEOMETRY = Geometry.bucket_multiples(7, (1, 2, 4, 8, 16))


def depths(flag: str, device=CPU_RULE, geometry=GEOMETRY) -> dict[int, int]:
    return draft_depths_for(parse_serve_args(["--model=m", f"--draft_depths={flag}"]), device, geometry)


def test_the_flag_resolves_per_bucket():
    assert depths("auto") == {4: 4, 8: 4, 16: 2}
    assert depths("auto", geometry=Geometry.bucket_multiples(3, (1, 2, 4, 8, 16))) == {16: 2}  # 4 is all of K=3
    assert depths("auto", device=DeviceSpec("cuda", "cuda", "float32", "cudagraph", "nccl")) == {}
    assert depths("full") == {}
    assert depths(" 16:2, 8:3 ") == {16: 2, 8: 3}
    assert depths("16:7") == {}  # depth K cuts nothing


@pytest.mark.parametrize("flag,message", [
    ("16", r"give auto, full or bucket:depth pairs such as 8:4,16:2 \(could not read '16'\)"),
    ("a:b", r"could not read 'a:b'"),
    ("32:2", r"request bucket 32 is not captured \(captured: \[1, 2, 4, 8, 16\]\)"),
    ("16:0", r"depth 0 for bucket 16 must lie in 1..7"),
    ("16:8", r"depth 8 for bucket 16 must lie in 1..7"),
    ("16:2,16:3", r"bucket 16 is given twice"),
])
def test_a_bad_flag_names_the_flag_and_the_value(flag, message):
    with pytest.raises(ConfigError, match=r"--draft_depths='[^']*': .*" + message):
        depths(flag)


def test_depths_are_part_of_the_table_fingerprint(tmp_path):
    """A table calibrated with cut blocks prices cheaper drafted steps: it is not reused with whole ones
    (and the other way round); a table saved before depths existed matches a launch with none."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")

    def fingerprint(flag):
        config = parse_serve_args([f"--model={tmp_path / 'm.gguf'}", f"--draft_depths={flag}"])
        return fingerprint_for(config, CPU_RULE, geometry=GEOMETRY)

    cut, whole = fingerprint("16:2"), fingerprint("full")
    assert whole.execution.draft_depths is None
    assert cut.execution.draft_depths == ((16, 2),)
    assert [m.describe() for m in compare(whole, cut)] == ["execution.draft_depths: saved null, launch [[16, 2]]"]
    assert compare(cut, fingerprint("16:2")) == []
    # a saved table reads its depths back (the run that calibrated this one had the CPU's auto depths)
    saved = load_table(ROOT / "benchmarks" / "results" / "avx2" / "draft-depths" / "cost-table-depths.json")
    assert saved.fingerprint.execution.draft_depths == ((4, 4), (8, 4), (16, 2))
