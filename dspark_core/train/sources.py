"""Where a training run's features come from: prompts, answers and the cached feature shards.

Two sources of answers (``PipelineOptions.answers``, one or both):

* ``on_policy`` — the frozen target answers each ShareGPT prompt greedily;
  the generating forwards give the features (one prefill, then one decode
  forward per token, ``gen_batch`` prompts at a time);
* ``sharegpt`` — ShareGPT's own answers, run through the target in one
  prefill forward per packed group of sequences (no decoding). The labels are
  still the target's own next-token distributions at every position, so the
  draft learns to imitate the target; only the text it conditions on was
  written by someone else.

With ``later_turns`` the later questions of the conversations (with their history) are
added, with the same sources (:mod:`dspark_core.train.later_turns`). Held-out sequences
are always on-policy answers to first-turn prompts no training sequence uses, because that
is what serving asks the draft to predict: calibration and the choice of checkpoint use them.

Features are stored in shards of ``shard_size`` sequences, so an interrupted
run continues at the first missing shard, across sessions. ``tiny=True``
swaps the real model and ShareGPT for a random tiny target and random
prompts/answers (seconds on a CPU; used by the tests).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dspark_core.errors import ConfigError
from dspark_core.train import data
from dspark_core.train.features import FeatureSet, compute_features, concat_features, generate_with_features
from dspark_core.train.options import PipelineOptions

STATS: dict[str, dict] = {}  # per feature stage of the last collect(): sequences, rows, seconds, rates (train-summary.json)


def tiny_target(device="cpu", dtype=torch.float32):
    """The random target tiny mode trains against (fixed seed)."""
    from dspark_core.models.random_models import random_target, tiny_target_config

    return random_target(tiny_target_config(max_position=256), seed=0, dtype=dtype, device=str(device))


def tiny_prompts(target, opts: PipelineOptions) -> list[list[int]]:
    g = torch.Generator().manual_seed(opts.settings.seed)
    vocab = target.config.vocab_size - 1
    return [torch.randint(vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(opts.prompts)]


def tiny_answers(target, opts: PipelineOptions, count: int) -> list[list[int]]:
    """Stand-ins for ShareGPT's answers in tiny mode: random token strings (not the target's own)."""
    g = torch.Generator().manual_seed(opts.settings.seed + 1)
    vocab = target.config.vocab_size - 1
    return [torch.randint(vocab, (int(torch.randint(8, opts.max_tokens + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def _suffix(opts: PipelineOptions, aux: tuple[int, ...]) -> str:
    dt = "" if opts.dtype == "float32" else f"-{opts.dtype}"
    skip = f"-from{opts.skip_prompts}" if opts.skip_prompts else ""  # shards are numbered from the first prompt used
    chars = f"{opts.min_prompt_chars}-{opts.max_prompt_chars}" if opts.min_prompt_chars != data.MIN_PROMPT_CHARS else opts.max_prompt_chars
    return f"-s{opts.settings.seed}-c{chars}-t{opts.max_tokens}{skip}-a{'-'.join(map(str, aux))}-k{opts.topk}{dt}"


_SHARD_NAMES = {  # source -> (tiny-mode folder, folder name after the target's)
    "on_policy": ("shards", "sharegpt"), "sharegpt": ("shards-sharegpt", "sharegpt-answers"),
    "pairs": ("shards-pairs-on-policy", "sharegpt-pairs-on-policy"),
    "later": ("shards-later", "sharegpt-later-answers"), "later-pairs": ("shards-later-on-policy", "sharegpt-later-on-policy"),
}


def shard_sources(opts: PipelineOptions) -> tuple[str, ...]:
    """The shard folders a run with these options reads (keys of ``_SHARD_NAMES``)."""
    if "sharegpt" not in opts.answers:
        return ("on_policy",)
    on_policy = "on_policy" in opts.answers
    later = (("later",) + (("later-pairs",) if on_policy else ())) if opts.later_turns else ()
    return (("pairs",) if on_policy else ()) + ("sharegpt",) + later


def shard_dir(opts: PipelineOptions, aux: tuple[int, ...], source: str = "on_policy") -> Path:
    """Where the feature shards of these options and ``source`` live.

    ``on_policy`` alone keeps the layout of earlier runs (prompts from
    :func:`data.sharegpt_prompts`); once ``sharegpt`` is among the sources every
    prompt comes from :func:`data.sharegpt_pairs`, and its on-policy answers go
    to ``...-pairs-on-policy``, ShareGPT's own to ``...-sharegpt-answers``.
    """
    tiny, name = _SHARD_NAMES[source]
    # later turns depend on how many, how much history, and which conversations the held-out prompts keep out
    later = f"-n{opts.later_turns}-x{opts.max_context_chars}-p{opts.prompts}-h{opts.heldout}" if source.startswith("later") else ""
    if opts.tiny:
        return opts.output / tiny
    base = Path(opts.features_dir or data.data_cache_dir().parent / "features")
    stem = Path(str(opts.target)).stem
    return base / f"{stem}-{name}{_suffix(opts, aux)}{later}"


def _shards(where: Path, items: list, chunk: int, make, log, what: str, minutes: float = 0.0):
    """Features of ``items`` in cached shards of ``chunk``; ``make(items)`` -> (prompts, answers, FeatureSet).

    Each shard records its prompts (and, for given answers, the answers); a
    shard holding other sequences is refused rather than silently mixed in.
    With ``minutes > 0`` no new shard is started once that much time has
    passed (shards already on disk are still read): the rest is left for a
    later run, which resumes there.
    """
    where.mkdir(parents=True, exist_ok=True)
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    parts: list[FeatureSet] = []
    started, made, made_answer = time.perf_counter(), 0, 0
    for n, s in enumerate(range(0, len(items), chunk)):
        path = where / f"part-{n:05d}-{chunk}.pt"
        group = items[s : s + chunk]
        want_prompts = [list(x[0]) if isinstance(x, tuple) else list(x) for x in group]
        if not path.is_file() and minutes > 0 and time.perf_counter() - started > 60 * minutes:
            log(f"{what}: time budget of {minutes} min reached; {len(prompts)} of {len(items)} sequences have features")
            break
        if path.is_file():
            shard = torch.load(path, weights_only=True)
            if shard["prompts"] != want_prompts or (isinstance(group[0], tuple) and shard["answers"] != [list(x[1]) for x in group]):
                raise ValueError(f"{path} holds other sequences; delete {where} to rebuild it")
        else:
            got_p, got_a, feats = make(group)
            shard = {"prompts": got_p, "answers": got_a, "features": feats.to_dict()}
            torch.save(shard, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
            made += int(feats.tokens.numel())
            made_answer += feats.answer_tokens
            log(f"{what}: {min(s + chunk, len(items))}/{len(items)} sequences "
                f"({made / max(time.perf_counter() - started, 1e-9):.0f} feature rows/s this session)")
        prompts.extend(shard["prompts"])
        answers.extend(shard["answers"])
        parts.append(FeatureSet(**shard["features"]))
    seconds = time.perf_counter() - started
    STATS[what] = {"sequences": len(prompts), "rows": sum(int(p.tokens.numel()) for p in parts),
                   "answer_tokens": sum(p.answer_tokens for p in parts), "seconds": round(seconds, 1),
                   "computed_rows": made, "computed_answer_tokens": made_answer,
                   "computed_rows_per_s": round(made / seconds, 1) if made else None,
                   "computed_answer_tokens_per_s": round(made_answer / seconds, 1) if made else None}
    return prompts, answers, parts


def _on_policy(target, opts: PipelineOptions, aux, prompt_ids: list[list[int]], where: Path, log, what: str, minutes: float = 0.0):
    def make(group):
        got, feats = generate_with_features(target, group, aux, max_tokens=opts.max_tokens, k=opts.topk, batch=opts.gen_batch,
                                           rows_per_forward=opts.rows_per_forward)
        return [p for p, _ in got], [a for _, a in got], feats

    return _shards(where, prompt_ids, opts.shard_size, make, log, what, minutes)


def _prefill(target, opts: PipelineOptions, aux, pairs: list[tuple[list[int], list[int]]], where: Path, log,
             what: str = "prefill features (ShareGPT answers)"):
    def make(group):
        feats = compute_features(target, group, aux, k=opts.topk, rows_per_forward=opts.rows_per_forward, progress=False)
        return [list(p) for p, _ in group], [list(a) for _, a in group], feats

    return _shards(where, pairs, opts.shard_size, make, log, what)


def _prompt_draw(opts: PipelineOptions) -> dict:
    """The keyword arguments of data.sharegpt_prompts / sharegpt_pairs for these options (one list either way)."""
    return {"limit": opts.prompts, "seed": opts.settings.seed, "min_chars": opts.min_prompt_chars,
            "max_chars": opts.max_prompt_chars}


def _tokenized(tokenizer, records, max_tokens: int) -> tuple[list[tuple[list[int], list[int]]], list]:
    """(prompt ids, answer ids) of (prompt, answer) records, and the prompts kept: answers of one
    token or none are dropped."""
    out, kept = [], []
    for prompt, answer in records:
        p, a = data.tokenize_pair(tokenizer, prompt, answer, max_tokens)
        if len(a) >= 2:
            out.append((p, a))
            kept.append(prompt)
    return out, kept


def _tokenized_pairs(target, opts: PipelineOptions) -> tuple[list[tuple[list[int], list[int]]], list]:
    """(prompt ids, answer ids) of ShareGPT pairs, and their prompt texts (tiny mode: the ids)."""
    if opts.tiny:
        prompts = tiny_prompts(target, opts)
        pairs = list(zip(prompts, tiny_answers(target, opts, len(prompts)), strict=True))[opts.skip_prompts:]
        return pairs, [p for p, _ in pairs]
    records = data.sharegpt_pairs(opts.sharegpt, **_prompt_draw(opts))
    return _tokenized(target.tokenizer, records[opts.skip_prompts:], opts.max_tokens)


def _later_pairs(target, opts: PipelineOptions, held_prompts: list) -> list[tuple[list[int], list[int]]]:
    """``opts.later_turns`` tokenized later-turn pairs, none from a held-out prompt's conversation."""
    if not opts.later_turns:
        return []
    if opts.tiny:  # longer random prompts (a history) and random answers
        g = torch.Generator().manual_seed(opts.settings.seed + 2)
        vocab = target.config.vocab_size - 1
        prompts = [torch.randint(vocab, (int(torch.randint(12, 30, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(opts.later_turns)]
        return list(zip(prompts, tiny_answers(target, opts, len(prompts)), strict=True))
    from dspark_core.train import later_turns

    records = later_turns.later_pairs(opts.sharegpt_later or opts.sharegpt, limit=opts.later_turns, seed=opts.settings.seed,
                                      exclude_first=held_prompts, min_chars=opts.min_prompt_chars,
                                      max_chars=opts.max_prompt_chars, max_context_chars=opts.max_context_chars)
    return _tokenized(target.tokenizer, records, opts.max_tokens)[0]


def collect(target, opts: PipelineOptions, aux: tuple[int, ...], log):
    """Training and held-out features: ``(train FeatureSet, held-out FeatureSet | None, held-out pairs)``."""
    STATS.clear()
    if "sharegpt" not in opts.answers:  # on-policy answers to data.sharegpt_prompts, the last `heldout` held out
        if opts.tiny:
            ids = tiny_prompts(target, opts)[opts.skip_prompts:]
        else:
            prompts = data.sharegpt_prompts(opts.sharegpt, **_prompt_draw(opts))
            ids = [data.chat_ids(target.tokenizer, p) for p in prompts[opts.skip_prompts:]]
        where = shard_dir(opts, aux, "on_policy")
        log(f"{len(ids)} prompts ({sum(map(len, ids))} tokens); on-policy shards in {where}")
        prompts_, answers, parts = _on_policy(target, opts, aux, ids, where, log, "on-policy answers with features")
        feats = concat_features(parts)
        pairs = list(zip(prompts_, answers, strict=True))
        train_idx, held_idx = split(pairs, opts.heldout)
        held = feats.subset(held_idx) if held_idx else None
        return feats.subset(train_idx), held, [pairs[i] for i in held_idx]
    pairs, texts = _tokenized_pairs(target, opts)
    cut = max(1, len(pairs) - opts.heldout) if len(pairs) > 1 else len(pairs)
    train_pairs, held_prompts = pairs[:cut], [p for p, _ in pairs[cut:]]
    log(f"{len(pairs)} ShareGPT pairs ({sum(len(p) for p, _ in pairs)} prompt and {sum(len(a) for _, a in pairs)} answer tokens); "
        f"{len(train_pairs)} for training, {len(held_prompts)} held-out prompts answered on-policy")
    later = _later_pairs(target, opts, texts[cut:])  # drawn before any feature: a source without later turns fails now
    if later:
        log(f"{len(later)} later-turn pairs ({sum(len(p) for p, _ in later)} prompt and {sum(len(a) for _, a in later)} "
            "answer tokens) for training")
    held, held_pairs = None, []
    if held_prompts:  # first: calibration and checkpoint choice need them
        # the held-out prompts are the tail of the --prompts list, so the folder names both counts: runs
        # with another --prompts hold other prompts and get their own shards instead of a refusal
        held_dir = shard_dir(opts, aux, "pairs") / f"heldout-{len(held_prompts)}-of-{len(pairs)}"
        hp, ha, hparts = _on_policy(target, opts, aux, held_prompts, held_dir, log, "held-out on-policy answers")
        held, held_pairs = concat_features(hparts), list(zip(hp, ha, strict=True))
    where = shard_dir(opts, aux, "sharegpt")
    log(f"prefill-only features of {len(train_pairs)} ShareGPT answers; shards in {where}")
    parts = _prefill(target, opts, aux, train_pairs, where, log)[2]
    if later:
        where = shard_dir(opts, aux, "later")
        log(f"prefill-only features of {len(later)} later-turn ShareGPT answers; shards in {where}")
        parts += _prefill(target, opts, aux, later, where, log, "prefill features (later turns)")[2]
    if "on_policy" in opts.answers:  # last, so that a time budget only trims this part
        started = time.perf_counter()
        if later:  # first: they are new prompts, while earlier drafts trained on the first turns' answers
            where = shard_dir(opts, aux, "later-pairs")
            log(f"on-policy answers to {len(later)} later-turn prompts; shards in {where}")
            parts += _on_policy(target, opts, aux, [p for p, _ in later], where, log, "on-policy answers (later turns)",
                                opts.on_policy_minutes)[2]
        # one budget for both: what the later turns used is gone (a spent budget still reads cached shards)
        minutes = max(opts.on_policy_minutes - (time.perf_counter() - started) / 60, 1e-9) if opts.on_policy_minutes else 0.0
        chosen = [p for p, _ in train_pairs][opts.on_policy_from :][: opts.on_policy_prompts or None]
        where = shard_dir(opts, aux, "pairs")
        if opts.on_policy_from:  # shards are numbered from the first prompt answered
            where = where / f"from-{opts.on_policy_from}"
        log(f"on-policy answers to {len(chosen)} training prompts (from prompt {opts.on_policy_from}); shards in {where}")
        parts += _on_policy(target, opts, aux, chosen, where, log, "on-policy answers with features", minutes)[2]
    return concat_features(parts), held, held_pairs


def extra_shards(opts: PipelineOptions, width: int) -> list[Path]:
    """The ``part-*.pt`` files of ``opts.extra_features``, checked against this run's feature layout.

    ``width`` is the hidden width this run's features have (aux layers × target hidden size). One shard per
    folder is opened here, before any feature is computed, so a folder made for another target, other
    ``--aux_layers`` or another ``--topk`` is refused at once rather than after hours of generation.
    """
    paths: list[Path] = []
    for directory in opts.extra_features:
        found = sorted(directory.glob("part-*.pt"))
        first = torch.load(found[0], weights_only=True)["features"]
        got = (int(first["hidden"].shape[1]), int(first["topk_ids"].shape[1]))
        if got != (width, opts.topk):
            raise ConfigError(f"--extra_features: {found[0]} has hidden width {got[0]} and top-{got[1]} labels; this run "
                              f"makes width {width} and top-{opts.topk} (another target, --aux_layers or --topk)")
        paths += found
    return paths


def read_extra(paths: list[Path], log) -> FeatureSet | None:
    """The sequences of ``paths`` (see :func:`extra_shards`) as one set, with their figures in ``STATS``."""
    if not paths:
        return None
    feats = concat_features([FeatureSet(**torch.load(p, weights_only=True)["features"]) for p in paths])
    STATS["extra features"] = {"shards": len(paths), "sequences": feats.num_sequences, "rows": int(feats.tokens.numel()),
                               "answer_tokens": feats.answer_tokens}
    log(f"extra features: {feats.num_sequences} sequences ({feats.answer_tokens} answer tokens) from {len(paths)} shards")
    return feats


def split(pairs: list, heldout: int) -> tuple[list[int], list[int]]:
    """Indices of training and held-out sequences (the last ``heldout`` are held out)."""
    n = len(pairs)
    cut = max(1, n - heldout) if n > 1 else n
    return list(range(cut)), list(range(cut, n))
