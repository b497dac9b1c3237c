"""Surgery settings and the recipe grammar: the settings of MLA, of healing and the base of every compress
method's (a recipe step and its command's options), and ``Recipe``, a whole run as a file.

Unknown keys are rejected so a typo in a recipe is an error, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import (
    Discriminator,
    Field,
    SerializeAsAny,
    Tag,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from attnsurg.requests import (
    EVAL_DOMAINS,
    Calibration,
    EvalDomainList,
    ModelRef,
    Strict,
    TextData,
)


# ------------------------------------------------------------------------- method settings (recipe steps)
class ConvertSettings(Strict):
    """A ``convert`` step: ``to`` names the target attention, whose settings class (a subclass, registered with
    its method in ``attnsurg.methods.base``) holds the rest; unwritten, the target is MLA."""

    to: str
    stream: bool | None = None  # one source layer in memory at a time; None: whenever the run allows it (``pipelines.source.streams``)

    @classmethod
    def accepts(cls, key: str) -> bool:
        """Whether ``key`` is an input of this target's settings (a command-line option it takes)."""
        return key in cls.model_fields

    def check_with(self, calibration: Calibration) -> None:
        """Raise ValueError where these settings cannot run on ``calibration`` (checked with the recipe)."""


DEFAULT_RATIO = 0.5  # a compress budget left unset: half of what the method sizes, as convert's --kv-budget 0.5


def ratio_unless_ranked(data, rank_fields: tuple[str, ...]):
    """A step's settings with ``ratio`` at ``DEFAULT_RATIO`` when they name neither a ratio nor a rank."""
    if isinstance(data, dict) and all(data.get(name) is None for name in ("ratio", *rank_fields)):
        return {**data, "ratio": DEFAULT_RATIO}
    return data


class CompressSettings(Strict):
    """A ``compress`` step: ``method`` names the method, whose own settings class (a subclass, registered with
    the method in ``attnsurg.methods.base``) holds the rest."""

    method: str
    stream: bool | None = None  # one source layer in memory at a time; None: whenever the run allows it (``pipelines.source.streams``)

    @classmethod
    def accepts(cls, key: str) -> bool:
        """Whether ``key`` is an input of this method's settings (a command-line option it takes)."""
        return key in cls.model_fields


class HealSettings(Strict):
    """``heal``: distill the teacher's next-token distribution (and optionally its residual stream after
    every layer, ``hidden_weight``) into the student on text.

    ``tokens`` is the training budget (optimizer steps = tokens / (seq_len x batch_size x grad_accum x
    processes)). ``train: attention`` trains only the attention modules (less any value a conversion
    holds fixed for exactness); ``all`` trains every parameter; ``lora`` trains rank-``lora_rank`` adapters
    on the attention projections and the attention's other parameters in full, and merges the adapters
    into the weights at the end (``attnsurg.adapters``); ``features`` trains only what a linear conversion
    added (its feature maps), so the softmax window stays the source's. ``teacher`` defaults to the recipe's source
    model when healing follows a surgery step.
    """

    teacher: ModelRef | None = None
    data: TextData = TextData(dataset="wiki-sample", part="calib")
    tokens: int = Field(100_000, gt=0)
    seq_len: int = Field(1024, gt=1)
    batch_size: int = Field(1, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(1.5e-4, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup: float = Field(0.05, ge=0, lt=1)
    kl_weight: float = Field(1.0, ge=0)
    lm_weight: float = Field(0.0, ge=0)
    hidden_weight: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    train: Literal["attention", "all", "lora", "features"] = "attention"
    lora_rank: int = Field(8, gt=0)  # train: lora (adapters on the attention projections)
    lora_alpha: float | None = Field(None, gt=0)  # None: 2 x lora_rank
    eval_every: int = Field(0, ge=0)
    eval_tokens: int = Field(2048, gt=1)
    save_every: int = Field(25, gt=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: memory for time

    @model_validator(mode="after")
    def _some_loss(self) -> HealSettings:
        if self.kl_weight == 0 and self.lm_weight == 0 and self.hidden_weight == 0:
            raise ValueError("kl_weight, lm_weight and hidden_weight are all 0: nothing to train on")
        return self

    @field_validator("data", mode="before")
    @classmethod
    def _calibration_part(cls, data):
        """Unwritten, the part is the calibration part; the eval part is refused."""
        part = data.get("part", "calib") if isinstance(data, dict) else getattr(data, "part", "calib")
        if part != "calib":
            raise ValueError("healing reads a dataset's calibration part (part: calib); the eval part is for scoring")
        return {**data, "part": "calib"} if isinstance(data, dict) else data


# ------------------------------------------------------------------------------------------- recipes
def compress_settings(value, handler) -> CompressSettings:
    """A compress step's settings, validated by the class its ``method`` registered."""
    from attnsurg.methods.base import compress_method_names, settings_for_method

    if isinstance(value, CompressSettings):
        return value
    method = value.get("method") if isinstance(value, dict) else None
    settings = settings_for_method(method) if isinstance(method, str) else None
    if settings is None:
        raise PydanticCustomError("compress_method", "compress needs method: one of {methods}",
                                  {"methods": ", ".join(compress_method_names())})
    return settings.model_validate(value)


def convert_settings(value, handler) -> ConvertSettings:
    """A convert step's settings, validated by the class its ``to`` registered (MLA's when unwritten)."""
    from attnsurg.methods.base import convert_target_names, settings_for_target

    if isinstance(value, ConvertSettings):
        return value
    target = value.get("to", "mla") if isinstance(value, dict) else None
    settings = settings_for_target(target) if isinstance(target, str) else None
    if settings is None:
        raise PydanticCustomError("convert_target", "convert needs to: one of {targets}",
                                  {"targets": ", ".join(convert_target_names())})
    return settings.model_validate(value)


class ConvertStep(Strict):
    convert: Annotated[SerializeAsAny[ConvertSettings], WrapValidator(convert_settings)]


class CompressStep(Strict):
    compress: Annotated[SerializeAsAny[CompressSettings], WrapValidator(compress_settings)]


class HealStep(Strict):
    heal: HealSettings


def surgery_step(settings: ConvertSettings | CompressSettings) -> ConvertStep | CompressStep:
    """The recipe step that holds these settings."""
    return ConvertStep(convert=settings) if isinstance(settings, ConvertSettings) else CompressStep(compress=settings)


STEP_KINDS = ("convert", "compress", "heal")


def step_kind(value) -> str | None:
    """A step is a mapping with exactly one key, the kind of step."""
    if isinstance(value, dict):
        return next(iter(value)) if len(value) == 1 and next(iter(value)) in STEP_KINDS else None
    return next((kind for kind in STEP_KINDS if getattr(value, kind, None) is not None), None)


Step = Annotated[
    Union[Annotated[ConvertStep, Tag("convert")], Annotated[CompressStep, Tag("compress")], Annotated[HealStep, Tag("heal")]],
    Discriminator(
        step_kind,
        custom_error_type="step_kind",
        custom_error_message="a step is a mapping with exactly one key: convert, compress or heal",
    ),
]


LONG_CONTEXT_MIN = 2048  # the long-context check's 16 needles fill about a third of 1K tokens


class Evaluation(Strict):
    """Scored after the surgery (and healing): the first ``tokens`` of the eval part of the calibration
    dataset and of each of ``domains`` (built-in texts; the calibration domain alone flatters every method),
    source and result on the same windows; and, at ``long_context`` tokens, retrieval and the perplexity of
    the last positions (``eval.long_context``)."""

    tokens: int = Field(2048, ge=0)
    domains: EvalDomainList = Field(default_factory=lambda: list(EVAL_DOMAINS))
    long_context: int = Field(0, ge=0, description="A length (e.g. 8192) at which retrieval and late-position "
                              "perplexity are also scored, source and result; 0: not scored.")

    @field_validator("long_context")
    @classmethod
    def _long_enough_for_the_needles(cls, value: int) -> int:
        if 0 < value < LONG_CONTEXT_MIN:
            raise ValueError(f"is {value} tokens; the long-context check needs at least {LONG_CONTEXT_MIN} "
                             "(its 16 needles fill about a third of 1K), or 0 for none")
        return value


class Recipe(Strict):
    """A whole run as a file: the model, one surgery step, optional healing, calibration, output and the
    evaluation after. Every convert/compress/heal command builds one of these and runs it."""

    description: str = ""
    model: ModelRef
    output: Path
    steps: list[Step] = Field(min_length=1)
    calibration: Calibration = Calibration()
    eval: Evaluation = Evaluation()
    seed: int = 0

    @model_validator(mode="after")
    def _supported_order(self) -> Recipe:
        kinds = [step_kind(step) for step in self.steps]
        surgeries = [k for k in kinds if k != "heal"]
        if len(surgeries) > 1:
            raise ValueError("a recipe holds at most one convert or compress step (chaining surgeries is not supported)")
        if surgeries and kinds[0] == "heal":
            raise ValueError("the convert or compress step comes first; heal follows it")
        if kinds.count("heal") > 1:
            raise ValueError("a recipe holds at most one heal step")
        if not surgeries and self.heal.teacher is None:
            raise ValueError("a heal-only recipe names its teacher (steps[0].heal.teacher): the original model")
        if surgeries and self.heal is not None and self.heal.teacher is not None:
            raise ValueError("after a surgery step the source model is the teacher; remove heal.teacher")
        for step in self.steps:
            if isinstance(step, ConvertStep):
                step.convert.check_with(self.calibration)
        return self

    @property
    def surgery(self) -> ConvertSettings | CompressSettings | None:
        for step in self.steps:
            if isinstance(step, ConvertStep):
                return step.convert
            if isinstance(step, CompressStep):
                return step.compress
        return None

    @property
    def heal(self) -> HealSettings | None:
        return next((step.heal for step in self.steps if isinstance(step, HealStep)), None)

    def with_heal(self, settings: HealSettings) -> Recipe:
        """The same recipe with its heal step's settings replaced."""
        steps = [HealStep(heal=settings) if isinstance(step, HealStep) else step for step in self.steps]
        return self.model_copy(update={"steps": steps})
