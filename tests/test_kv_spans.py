"""KV spans: keys that read the KV cache are also prepared for a few shorter lengths, and each step
replays the shortest one that holds every position it may touch (the captured decode path)."""

from __future__ import annotations

import pytest
import torch

from dspark_core.config import ServeConfig
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.geometry import kv_spans, span_for
from dspark_core.graphs import GraphError, static_kv_length, static_shapes
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_core.validate import config_problems
from capture_support import StandInCapturedBackend
from engine_support import greedy_references, random_prompts

CFG = tiny_target_config(max_position=256)


def test_auto_spans_double_below_the_cache_on_capturing_backends_only():
    assert kv_spans("auto", 2048, captured=True) == (256, 512, 1024)
    assert kv_spans("auto", 256, captured=True) == ()
    assert kv_spans("auto", 2048, captured=False) == ()
    assert kv_spans("off", 2048, captured=True) == ()
    assert kv_spans(" 64, 16,64 ", 96, captured=False) == (16, 64)  # an explicit list holds on any backend


@pytest.mark.parametrize("value", ["x", "0", "96", "16,-1", ""])
def test_bad_spans_are_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match=r"--captured_kv_spans="):
        kv_spans(value, 96, captured=True)
    problems = config_problems(ServeConfig(model="smollm2", draft_model="default", max_model_len=96, captured_kv_spans=value))
    assert any(p.startswith("captured_kv_spans=") for p in problems), problems


def test_span_for_takes_the_shortest_span_that_holds_the_length():
    assert [span_for((16, 32, 64), n) for n in (1, 16, 17, 32, 64, 65)] == [16, 16, 32, 32, 64, 0]
    assert span_for((), 5) == 0


def test_static_forward_reads_the_span_and_refuses_one_past_the_cache():
    assert static_kv_length(96) == 96
    with static_shapes(32):
        assert static_kv_length(96) == 32
        with pytest.raises(GraphError, match="KV span 32 is longer than the cache"):
            static_kv_length(16)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_replays_shorter_spans_and_stays_exact(overlap):
    """Requests grow through the 16/32/64 spans and past them into the whole cache: every step's
    keys read only their span, and the output is target-only greedy's."""
    target = random_target(CFG, seed=7, dtype=torch.float64)
    draft = random_draft(CFG, seed=5, block_size=7).to(torch.float64)
    backend = StandInCapturedBackend("cpu")
    config = EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2, 4), max_model_len=96,
                          schedule_overlap=overlap, captured_kv_spans="16,32,64", copy_proposals="on")
    engine = Engine(target, draft, config, graphs=backend)
    engine.warmup()
    engine.mark_ready()
    assert {k.kv_span for k in backend.keys if k.stage != "copy"} == {0, 16, 32, 64}
    used: list[int] = []
    reached: list[tuple[int, int]] = []
    run = backend.run

    def recording_run(key, inputs):
        used.append(key.kv_span)
        outputs = run(key, inputs)
        if key.stage.startswith("verify") and key.kv_span:  # every row the target ran sits inside the span
            reached.append((int(outputs[4].max()), key.kv_span))
        return outputs

    backend.run = recording_run
    prompts = [p[:3] for p in random_prompts(3, seed=9)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=72, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == greedy_references(target, prompts, 72)
    # copies of the looping greedy text are accepted, so drafted rows near a span's end count
    assert engine.counters.steps < 60, engine.counters  # 72 tokens each without acceptance
    assert {16, 32, 64, 0} <= set(used)
    assert all(position < span for position, span in reached)
    assert any(span - position <= 2 * (5 + 1) for position, span in reached)  # steps came within the reserve of its end
    assert used == sorted(used, key=lambda s: s or 10**9)  # spans only grow as the requests do
