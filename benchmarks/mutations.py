"""Mutation check: six hand-made bugs in the accept/commit path and the policy, each of which the
default test suite must catch (issue 18).

Each mutation is applied to the working tree, the engine, policy and kernel tests run, and the file
is restored (also on Ctrl-C). The files it touches must have no uncommitted changes. About 8
minutes on the project's 2-core CPU:

    python benchmarks/mutations.py            # all six
    python benchmarks/mutations.py tier_lag_ignored
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_engine.py", "tests/test_draft_off.py", "tests/test_policies.py", "tests/test_kernels.py",
         "tests/test_sync_free_step.py", "tests/test_policies_peers.py"]
# name: (file, original text, mutated text)
MUTATIONS = {
    "kv_length_advances_by_accepted": (
        "dspark_core/engine/step.py", "storage.seq_len[step.slots] += acceptance.accepted + 1",
        "storage.seq_len[step.slots] += acceptance.accepted"),
    "bonus_token_from_accepted_minus_1": (
        "dspark_core/engine/step.py", "acceptance.committed.gather(1, acceptance.accepted.unsqueeze(1))",
        "acceptance.committed.gather(1, (acceptance.accepted - 1).clamp(min=0).unsqueeze(1))"),
    "accepts_one_row_past_verified_length": (
        "kernels/accept_commit.py", "(column.unsqueeze(0) < lengths.unsqueeze(1))",
        "(column.unsqueeze(0) <= lengths.unsqueeze(1))"),
    "acceptance_without_prefix_product": (
        "kernels/accept_commit.py", "accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)",
        "accepted = match.to(torch.int64).sum(dim=1)"),
    "ties_go_to_larger_tier": (
        "dspark_core/policy.py", "best = rate.index(max(r for r in rate if r == r))",
        "best = len(rate) - 1 - rate[::-1].index(max(r for r in rate if r == r))"),
    "tier_lag_ignored": ("dspark_core/engine/planning.py", "lag = policy.tier_lag", "lag = 0"),
}


def run(name: str) -> list[str]:
    """Apply one mutation, run the tests, restore; the failing test ids."""
    path, original, mutated = MUTATIONS[name]
    file = ROOT / path
    source = file.read_text()
    if source.count(original) != 1:
        raise SystemExit(f"{name}: the text to mutate is not found exactly once in {path}; update MUTATIONS")
    file.write_text(source.replace(original, mutated))
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *TESTS],
                                cwd=ROOT, capture_output=True, text=True)
    finally:
        file.write_text(source)
    return [line.split(" - ")[0].removeprefix("FAILED ") for line in result.stdout.splitlines()
            if line.startswith("FAILED")]


def main() -> int:
    names = sys.argv[1:] or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; known: {sorted(MUTATIONS)}")
    paths = sorted({MUTATIONS[n][0] for n in names})
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"uncommitted changes in files this check mutates:\n{dirty}")
    survivors = []
    for name in names:
        failed = run(name)
        print(f"{name}: {len(failed)} failing test(s)" + (f", e.g. {failed[0]}" if failed else " -- SURVIVED"),
              flush=True)
        if not failed:
            survivors.append(name)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
