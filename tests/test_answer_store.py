"""benchmarks/answer_store.py: replaying answers with own copies and a store of other answers."""

from __future__ import annotations

import pytest
from script_support import load_script


@pytest.fixture(scope="module")
def store_module():
    return load_script("answer_store")


def test_the_store_follows_the_continuation_most_occurrences_agree_on(store_module):
    store = store_module.AnswerStore(orders=(3, 2))
    store.add([1, 2, 3, 4, 5, 6])
    store.add([9, 2, 3, 4, 5, 7])
    store.add([8, 2, 3, 4, 0, 0])
    # the 3-token key (1, 2, 3) occurs in answer 0 only, which ends after 6
    assert store.propose([1, 2, 3], width=4) == [4, 5, 6]
    # order 3 misses (7, 2, 3); order 2 (2, 3) occurs in all three: 4 by all, then 5 by two of three, then 6 or 7
    proposal = store.propose([7, 2, 3], width=4)
    assert proposal[:2] == [4, 5] and proposal[2] in (6, 7) and len(proposal) == 3
    assert store.propose([5, 5], width=4) == []


def test_min_count_stops_a_continuation_too_few_occurrences_share(store_module):
    store = store_module.AnswerStore(orders=(2,), min_count=2)
    store.add([1, 2, 3, 4])
    store.add([1, 2, 3, 5])
    assert store.propose([1, 2], width=3) == [3]  # 3 by both, then 4 and 5 by one each


def test_replay_commits_copies_and_counts_draft_positions(store_module):
    # the answer repeats its opening: from the second "10 11 12" on, own copies commit runs
    prompt, answer = [1], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    counts = store_module.replay([(prompt, answer)], width=3, store=None, orders=(2,))
    assert counts["own tokens"] + counts["draft positions"] == len(answer) - 1
    assert counts["own steps"] >= 1 and counts["own tokens"] > counts["own steps"]
    # a store holding the same answer proposes where the answer's own history cannot yet
    store = store_module.AnswerStore(orders=(2,))
    store.add([0] + answer)
    with_store = store_module.replay([(prompt, answer)], width=3, store=store, orders=(2,))
    assert with_store["draft positions"] < counts["draft positions"]
    tau_without = store_module.estimated_tau(counts, draft_tau=1.0)
    assert store_module.estimated_tau(with_store, draft_tau=1.0) > tau_without > 1.0
