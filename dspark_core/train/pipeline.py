"""End-to-end draft training: prompts -> target-labelled answers -> cached features -> trained draft.

Two sources of answers (``PipelineOptions.answers``, one or both):

* ``on_policy`` — the frozen target answers each ShareGPT prompt greedily;
  the generating forwards give the features (one prefill, then one decode
  forward per token, ``gen_batch`` prompts at a time);
* ``sharegpt`` — ShareGPT's own first answers, run through the target in one
  prefill forward per packed group of sequences (no decoding). The labels are
  still the target's own next-token distributions at every position, so the
  draft learns to imitate the target; only the text it conditions on was
  written by someone else.

Held-out sequences are always on-policy answers (to prompts no training
sequence uses), because that is what serving asks the draft to predict:
calibration and the choice of checkpoint use them.

Every stage is cached, so re-running the same command resumes: features are
stored in shards of ``shard_size`` sequences (an interrupted run continues at
the first missing shard, across sessions), and the training loop resumes from
``checkpoint.pt``. ``tiny=True`` swaps the real model and ShareGPT for a random
tiny target and random prompts/answers (seconds on a CPU; used by the tests).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from attrs import field, frozen

from dspark_core.errors import ConfigError
from dspark_core.models.drafts import resolve_draft_path
from dspark_core.models.speculators_io import load_draft, read_draft_config, save_draft
from dspark_core.train import data
from dspark_core.train.features import (
    FeatureSet,
    compute_features,
    concat_features,
    generate_with_features,
)
from dspark_core.train.train import (
    TrainSettings,
    copy_target_layers,
    heldout_stats,
    init_draft,
    make_draft_config,
    start_from_draft,
    target_to_draft_ids,
    train,
)

SOURCES = ("on_policy", "sharegpt")
STATS: dict[str, dict] = {}  # per feature stage of the last collect(): sequences, rows, seconds, rates (train-summary.json)


def _answers(value) -> tuple[str, ...]:
    items = tuple(x.strip() for x in (value.split(",") if isinstance(value, str) else value) if x.strip())
    bad = [x for x in items if x not in SOURCES]
    if bad or not items:
        raise ConfigError(f"--answers: {','.join(bad) or 'nothing'}: choose on_policy, sharegpt or on_policy,sharegpt")
    return tuple(dict.fromkeys(items))


def _min_prompt_chars(options: PipelineOptions, attribute, value: int) -> None:
    if not 1 <= value <= options.max_prompt_chars:
        raise ConfigError(f"--min_prompt_chars must be at least 1 and at most --max_prompt_chars ({options.max_prompt_chars}), got {value}")


def _feature_dirs(value) -> tuple[Path, ...]:
    items = value.split(",") if isinstance(value, str) else value
    return tuple(Path(str(x).strip()) for x in items if str(x).strip())


def _has_shards(options: PipelineOptions, attribute, value: tuple[Path, ...]) -> None:
    for directory in value:
        if not any(directory.glob("part-*.pt")):
            raise ConfigError(f"--extra_features: {directory} holds no feature shards (part-*.pt)")


def _at_least_one(options: PipelineOptions, attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(f"--{attribute.name} must be at least 1, got {value}")


def _on_policy_from(options: PipelineOptions, attribute, value: int) -> None:
    if value < 0:
        raise ConfigError(f"--on_policy_from must be at least 0, got {value}")
    if value and set(options.answers) != {"on_policy", "sharegpt"}:
        raise ConfigError(f"--on_policy_from {value} needs --answers=on_policy,sharegpt (got {','.join(options.answers)}): "
                          "it picks which training prompts of the ShareGPT pairs are answered on-policy")


def _later_turns(options: PipelineOptions, attribute, value: int) -> None:
    if value < 0:
        raise ConfigError(f"--later_turns must be at least 0, got {value}")
    if value and "sharegpt" not in options.answers:
        raise ConfigError(f"--later_turns {value} needs ShareGPT pairs, i.e. --answers=sharegpt or on_policy,sharegpt "
                          f"(got {','.join(options.answers)})")


def _skip_prompts(options: PipelineOptions, attribute, value: int) -> None:
    if not 0 <= value < options.prompts:
        raise ConfigError(f"--skip_prompts must be at least 0 and below --prompts ({options.prompts}), got {value}")


def _heldout(options: PipelineOptions, attribute, value: int) -> None:
    used = options.prompts - options.skip_prompts
    if not 0 <= value < used:
        raise ConfigError(f"--heldout must be at least 0 and below the {used} prompts this run answers (--prompts "
                          f"{options.prompts} minus --skip_prompts {options.skip_prompts}), got {value}; "
                          "the held-out answers come out of those prompts")


@frozen
class PipelineOptions:
    target: str = "smollm2"
    output: Path = field(default=Path("draft-run"), converter=Path)
    prompts: int = field(default=900, validator=_at_least_one)
    # leave out the first N of the --prompts prompts (those an earlier stage trained on): a fine-tuning stage
    # then answers only new prompts, and keeps its shards apart from the full list's
    skip_prompts: int = field(default=0, validator=_skip_prompts)
    heldout: int = field(default=64, validator=_heldout)
    max_tokens: int = 128
    max_prompt_chars: int = 500
    # shortest prompt used; a stage on long prompts only (e.g. 501..2000) meets none an earlier stage met
    min_prompt_chars: int = field(default=data.MIN_PROMPT_CHARS, validator=_min_prompt_chars)
    gen_batch: int = 16
    layers: int = 1
    block_size: int = 7
    draft_vocab: int = 24576
    markov_rank: int = 64
    markov_type: str = "vanilla"
    aux_layers: tuple[int, ...] | None = None
    topk: int = 16
    features_dir: Path | None = None
    # shard folders of earlier runs trained on as well (read as they are, nothing recomputed): one stage can mix
    # prompt ranges, e.g. long prompts with the short ones an earlier stage answered
    extra_features: tuple[Path, ...] = field(default=(), converter=_feature_dirs, validator=_has_shards)
    answers: tuple[str, ...] = field(default=("on_policy",), converter=_answers)
    sharegpt: Path | None = None  # the wheel, its JSON, or an extract (data.write_sharegpt_extract); None: download
    on_policy_prompts: int = 0  # with answers=on_policy,sharegpt: answer only the first N training prompts on-policy (0 = all)
    # with answers=on_policy,sharegpt: start the on-policy answers at this training prompt. A run on a fresh machine
    # (a GPU lent for minutes) then answers the prompts an earlier run had no time for, instead of the same ones again
    on_policy_from: int = field(default=0, validator=_on_policy_from)
    on_policy_minutes: float = 0.0  # with answers=on_policy,sharegpt: start no new on-policy shard after this long (0 = no limit)
    # later turns of ShareGPT conversations added to training (train.later_turns): how many pairs, how many characters
    # of history each keeps, and their source (None: --sharegpt; a first-turn extract holds none)
    later_turns: int = field(default=0, validator=_later_turns)
    max_context_chars: int = field(default=2000, validator=_at_least_one)
    sharegpt_later: Path | None = None
    shard_size: int = 64
    rows_per_forward: int = 2048  # prefill-only source: rows per target forward
    init_from_target_layer: int | None = None
    init_draft: str | None = None  # fine-tune this draft (directory or "default") instead of a fresh one
    baseline_draft: str | None = None  # a draft directory (or "default") measured on the same held-out set, for comparison
    device: str = "cpu"
    dtype: str = "float32"
    features_on_device: bool = False  # keep the training features on the device (GPU: no host gather per step)
    tiny: bool = False
    settings: TrainSettings = field(factory=TrainSettings)


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


def _shard_sources(opts: PipelineOptions) -> tuple[str, ...]:
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
        got, feats = generate_with_features(target, group, aux, max_tokens=opts.max_tokens, k=opts.topk, batch=opts.gen_batch)
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


def run_pipeline(opts: PipelineOptions, *, progress: bool = True, log=print):
    """Train a draft; returns ``(draft, target, losses, heldout_file)``.

    The result is saved to ``output/draft``. With held-out evaluation on
    (``settings.eval_every > 0`` and held-out sequences), that is the
    checkpoint with the best held-out τ (``draft-best``); the final weights are
    in ``draft-last`` and the τ curve in ``curve.jsonl``.
    """
    from dspark_core.train.runtime import resolve_device, resolve_dtype

    device, dtype = resolve_device(opts.device), resolve_dtype(opts.dtype)
    opts.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if opts.tiny:
        target = tiny_target(device, dtype)
    else:
        from dspark_core.models.loading import load_target

        target = load_target(opts.target, device=device, dtype=dtype)
    cfg = make_draft_config(target.config, num_layers=opts.layers, block_size=opts.block_size, aux_layer_ids=opts.aux_layers,
                            draft_vocab_size=opts.draft_vocab, markov_rank=opts.markov_rank, markov_head_type=opts.markov_type)
    start = None
    if opts.init_draft:  # checked before the features are made, which can take hours
        if opts.init_from_target_layer is not None:
            raise ConfigError("--init_draft and --init_from_target_layer both say where the draft starts; give one")
        start = start_from_draft(resolve_draft_path(opts.init_draft, opts.target), cfg, opts.settings.seed)
    extra = extra_shards(opts, len(cfg.aux_layer_ids) * target.config.hidden_size)
    t1 = time.perf_counter()
    train_feats, held, held_pairs = collect(target, opts, cfg.aux_layer_ids, log)
    more = read_extra(extra, log)
    if more is not None:
        train_feats = concat_features([train_feats, more])
    t2 = time.perf_counter()
    held_file = opts.output / "heldout.jsonl"
    data.write_generations(held_file, [p for p, _ in held_pairs], [a for _, a in held_pairs])
    if held is not None:
        torch.save(held.to_dict(), opts.output / "heldout-features.pt")
    log(f"features: {train_feats.num_sequences} training sequences, {int(train_feats.tokens.numel())} rows "
        f"({train_feats.answer_tokens} answer tokens); {len(held_pairs)} held-out sequences")
    baseline = None
    if opts.baseline_draft and held is not None:
        path = resolve_draft_path(opts.baseline_draft, opts.target)
        other = load_draft(path, device=device).bind_target(target)
        baseline = {"draft": str(path), **heldout_stats(other, held, opts.settings, target_to_draft_ids(other).to(held.hidden.device))}
        log(f"baseline {path} on the held-out set: tau {baseline['tau']:.4f} acc1 {baseline['acc1']:.4f}")
        del other
    if start is not None:
        draft = start
        log(f"fine-tuning {opts.init_draft} (its weights and vocabulary; STS temperatures dropped)")
        own_layers = read_draft_config(resolve_draft_path(opts.init_draft, opts.target)).num_layers
        if own_layers < opts.layers:
            log(f"grown from {own_layers} to {opts.layers} layers: the new ones add nothing until trained")
    else:
        draft = init_draft(cfg, train_feats, opts.settings.seed)
    if opts.init_from_target_layer is not None:
        used = copy_target_layers(draft, target, opts.init_from_target_layer)
        log(f"draft layers initialised from target layers {used}")
    draft.to(device)
    verifier = opts.target if not opts.tiny else None
    evaluate = held is not None and opts.settings.eval_every > 0
    best_dir = opts.output / "draft-best"

    def on_best(d, step: int, tau: float) -> None:
        save_half(d, best_dir, verifier=verifier)

    feats_in = train_feats.to(device) if opts.features_on_device else train_feats
    held_in = (held.to(device) if opts.features_on_device else held) if evaluate else None
    losses, info = train(draft, target, feats_in, opts.settings, opts.output, progress=progress, log=log,
                         heldout=held_in, on_best=on_best if evaluate else None, with_info=True,
                         start_is_candidate=start is not None)
    t3 = time.perf_counter()
    out = opts.output / "draft"
    if evaluate:
        save_half(draft, opts.output / "draft-last", verifier=verifier)
        chosen = best_dir if best_dir.is_dir() else opts.output / "draft-last"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(chosen, out)
    else:
        save_half(draft, out, verifier=verifier)
    (opts.output / "train-summary.json").write_text(json.dumps({
        "answers": list(opts.answers), "device": str(device), "dtype": opts.dtype,
        "shards": {src: str(shard_dir(opts, cfg.aux_layer_ids, src)) for src in _shard_sources(opts)},
        "train_sequences": train_feats.num_sequences, "train_rows": int(train_feats.tokens.numel()),
        "train_answer_tokens": train_feats.answer_tokens, "heldout_sequences": len(held_pairs),
        "extra_features": [str(d) for d in opts.extra_features],
        "init_from_target_layer": opts.init_from_target_layer, "init_draft": opts.init_draft,
        "later_turns": opts.later_turns, "max_context_chars": opts.max_context_chars,
        "skip_prompts": opts.skip_prompts, "prompt_chars": [opts.min_prompt_chars, opts.max_prompt_chars], "steps": opts.settings.steps, "ce_weight": opts.settings.ce_weight, "steps_done": len(losses), "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None, "chosen": "draft-best" if evaluate and best_dir.is_dir() else "last",
        "best": info.get("best"), "baseline": baseline, "feature_stages": dict(STATS), "seconds": {"load": round(t1 - t0, 1), "features": round(t2 - t1, 1), "train": round(t3 - t2, 1)},
    }, indent=2) + "\n")
    log(f"draft saved to {out}")
    return draft, target, losses, held_file


def save_half(draft, directory: Path, *, verifier: str | None = None) -> Path:
    """Save with float16 weights (load_draft converts back); the in-memory draft stays float32."""
    lm_head = draft.lm_head
    draft.half()
    try:
        return save_draft(draft, directory, verifier=verifier)
    finally:
        draft.float()
        draft.lm_head = lm_head
