"""Typed requests: every command builds one of these, and a YAML recipe can build the same objects.

Method code receives these objects (or plain values taken from them) and never reads CLI state.
Unknown keys are rejected so a typo in a recipe is an error, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializeAsAny,
    Tag,
    WrapValidator,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from attnsurg.errors import UserError

DType = Literal["auto", "float32", "bfloat16", "float16"]
Runtime = Literal["attnsurg", "stock"]  # how a DeepseekV3 model attends at inference: absorbed, or transformers' own


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(Strict):
    """A model to load: a local directory, a .gguf file, a hub id or a built-in name.

    In a recipe a bare string is short for ``{ref: STRING}``, and a reference with no flags is written back
    as that string.
    """

    ref: str
    trust_remote_code: bool = False
    allow_pickle: bool = False

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value):
        return {"ref": value} if isinstance(value, str) else value

    @model_serializer(mode="wrap")
    def _as_string_when_plain(self, handler):
        if not self.trust_remote_code and not self.allow_pickle:
            return self.ref
        return handler(self)


EVAL_DOMAINS = ("wiki-sample", "c4-sample", "code-sample")


def check_domains(domains: list[str]) -> list[str]:
    from attnsurg.data import DOMAINS

    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown evaluation domain '{unknown[0]}'; choose from {', '.join(DOMAINS)}")
    return list(dict.fromkeys(domains))


EvalDomainList = Annotated[list[str], AfterValidator(check_domains)]


class TextData(Strict):
    """Text to read: a built-in dataset or a UTF-8 file, and which part of it."""

    dataset: str | None = None
    text: Path | None = None
    part: Literal["eval", "calib"] = "eval"

    @model_validator(mode="after")
    def _one_source(self) -> TextData:
        if self.dataset and self.text:
            raise ValueError("give either dataset or text, not both")
        return self

    @field_validator("dataset")
    @classmethod
    def _known_datasets(cls, dataset: str | None) -> str | None:
        """Every name checked when the request is made, before any model loads."""
        from attnsurg.data import parse_datasets

        if dataset is not None:
            try:
                parse_datasets(dataset)
            except UserError as exc:
                raise ValueError(str(exc)) from None
        return dataset

    @field_validator("text")
    @classmethod
    def _text_exists(cls, text: Path | None) -> Path | None:
        if text is not None and not Path(text).expanduser().is_file():
            raise ValueError(f"text file '{text}' does not exist")
        return text

    def datasets(self) -> list[str]:
        """The built-in datasets named (``all`` expanded), in order; empty for a user's file."""
        from attnsurg.data import parse_datasets

        return parse_datasets(self.dataset) if self.dataset and self.text is None else []

    def scored(self) -> TextData:
        """The text whose eval part is scored as "this text": itself, or the first of several datasets."""
        names = self.datasets()
        return TextData(dataset=names[0]) if len(names) > 1 else self


class PerplexityEval(Strict):
    """``attnsurg eval perplexity``: the same windows for every model, scored in one run."""

    models: list[ModelRef] = Field(min_length=1)
    data: TextData = TextData(dataset="wiki-sample")
    more_data: list[TextData] = Field(default_factory=list, description="Further texts scored on the same settings.")
    max_length: int = Field(1024, gt=1)
    stride: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, gt=1)
    batch_size: int = Field(1, gt=0)
    dtype: DType = "auto"
    device: str = "auto"
    seed: int = 0

    @property
    def effective_stride(self) -> int:
        return self.stride or self.max_length

    @property
    def texts(self) -> list[TextData]:
        return [self.data, *self.more_data]

    @model_validator(mode="after")
    def _stride_within_window(self) -> PerplexityEval:
        if self.stride is not None and self.stride > self.max_length:
            raise ValueError(f"stride ({self.stride}) must not exceed max_length ({self.max_length})")
        if self.max_tokens is not None and self.max_tokens < self.max_length:
            raise ValueError(f"max_tokens ({self.max_tokens}) is smaller than one window ({self.max_length})")
        return self


TASK_NAMES = ("facts", "cloze", "passkey")


class TasksEval(Strict):
    """``attnsurg eval tasks``: zero-shot tasks scored the way lm-evaluation-harness scores them, every model
    on the same items."""

    models: list[ModelRef] = Field(min_length=1)
    tasks: list[Literal["facts", "cloze", "passkey"]] = Field(default_factory=lambda: list(TASK_NAMES))
    lm_eval: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks, run by the harness.")
    lm_eval_include: Path | None = Field(None, description="A folder of extra lm-evaluation-harness task YAML files.")
    limit: int | None = Field(None, gt=0, description="At most this many items per task (facts, cloze, lm-eval).")
    cloze_items: int = Field(300, gt=0)
    passkey_lengths: list[int] | None = None
    max_length: int = Field(2048, gt=1, description="Longest input for log-likelihood items (left-truncated).")
    dtype: DType = "auto"
    device: str = "auto"

    @model_validator(mode="after")
    def _something_to_run(self) -> TasksEval:
        if not self.tasks and not self.lm_eval:
            raise ValueError("no task to run: name built-in tasks (facts, cloze, passkey) or lm-evaluation-harness tasks")
        return self


class SpeedEval(Strict):
    """``attnsurg eval speed``: prefill and decode throughput, KV cache held and peak memory per context."""

    models: list[ModelRef] = Field(min_length=1)
    contexts: list[int] = Field(default_factory=lambda: [1024, 4096], min_length=1)
    new_tokens: int = Field(64, ge=0)
    repeats: int = Field(3, gt=0)
    warmup: int = Field(1, ge=0)
    batch: int = Field(1, gt=0, description="Sequences decoded together.")
    runtimes: list[Runtime] = Field(default_factory=lambda: ["attnsurg", "stock"], min_length=1)
    dtype: DType = "auto"
    device: str = "auto"
    seed: int = 0

    @field_validator("contexts")
    @classmethod
    def _positive(cls, contexts: list[int]) -> list[int]:
        if any(c < 1 for c in contexts):
            raise ValueError("contexts must be positive token counts")
        return contexts


class GenerateRequest(Strict):
    """``attnsurg generate``: one prompt, tokens streamed as they are decoded."""

    model: ModelRef
    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(128, gt=0)
    chat: bool = True  # through the tokenizer's chat template when it has one
    temperature: float = Field(0.0, ge=0)  # 0: greedy
    runtime: Runtime = "attnsurg"
    dtype: DType = "auto"
    device: str = "auto"
    seed: int = 0


class AnalyzeRequest(Strict):
    """``attnsurg analyze``: spectra, RoPE energy and sparsity of a model's attention on real text."""

    model: ModelRef
    output: Path
    data: TextData = TextData(dataset="wiki-sample", part="calib")
    tokens: int = Field(8192, gt=1)
    seq_len: int = Field(1024, gt=1)
    layers: list[int] | None = None  # None: every layer
    attention_windows: int = Field(2, gt=0, description="Windows whose attention matrices are analysed.")
    device: str = "auto"
    overwrite: bool = False


class ApproxRequest(Strict):
    """``attnsurg analyze approx``: the survey's attention approximations on a model's own Q, K, V."""

    model: ModelRef
    output: Path
    data: TextData = TextData(dataset="wiki-sample", part="calib")
    seq_len: int = Field(1024, gt=1)
    layers: list[int] | None = Field(default_factory=list, description="Empty: the first, middle and last layers; "
                                                                        "None: every layer.")
    budgets: list[float] = Field(default_factory=lambda: [1 / 16, 1 / 8, 1 / 4], min_length=1)
    device: str = "auto"
    overwrite: bool = False

    @field_validator("budgets")
    @classmethod
    def _shares(cls, budgets: list[float]) -> list[float]:
        if any(not 0 < b <= 1 for b in budgets):
            raise ValueError("budgets are shares of exact attention's cost, in (0, 1]")
        return sorted(budgets)


class InfoRequest(Strict):
    """``attnsurg info``: the attention anatomy of one model, read from its config."""

    model: ModelRef


class Calibration(Strict):
    """Calibration text (always its calibration part) and how much of it to use."""

    data: TextData = TextData(dataset="wiki-sample", part="calib")
    tokens: int = Field(4096, gt=0)
    seq_len: int = Field(512, gt=1)

    @field_validator("data", mode="before")
    @classmethod
    def _calibration_part(cls, data):
        """Calibration has only ever read the calibration part; recipes written before the part was recorded
        as such say ``part: eval`` and still reproduce their checkpoints."""
        if isinstance(data, dict):
            return {**data, "part": "calib"}
        return data.model_copy(update={"part": "calib"}) if isinstance(data, TextData) else data


COMMAND_CALIBRATION = Calibration(data=TextData(dataset="all", part="calib"))
"""What ``convert`` and ``compress`` calibrate on when no ``--calib-*`` option is given (and the Python API when no
``calibration`` is): every built-in domain in turn. A recipe that leaves its calibration out reads ``Calibration()``."""


class PlanRequest(Strict):
    """``attnsurg analyze plan``: per method, the smallest budget predicted to keep the perplexity ratio within
    ``target_ratio`` on the calibration text's eval part and on every one of ``eval_domains``."""

    model: ModelRef
    output: Path
    target_ratio: float = Field(1.3, gt=1)
    methods: list[str] = Field(default_factory=lambda: ["svdllm", "loki", "mla"], min_length=1)
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, gt=0)
    eval_domains: EvalDomainList = Field(default_factory=lambda: list(EVAL_DOMAINS))
    verify: bool = False
    seed: int = 0
    device: str = "auto"
    overwrite: bool = False


class SurgeryContext(Strict):
    """What every surgery request carries besides its method's settings."""

    model: ModelRef
    output: Path
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, ge=0)
    eval_domains: EvalDomainList = Field(default_factory=lambda: list(EVAL_DOMAINS))
    overwrite: bool = False
    seed: int = 0
    device: str = "auto"  # where calibration and refinement run; not part of the recipe file


# ------------------------------------------------------------------------- method settings (recipe steps)
# MLA's calibration: 12 windows of 512 over the six domains in turn, the first half refined on (one window of
# every domain), the next two held out. Against 4096 (four domains refined on, one multilingual window held
# out) with 40 steps, at 0.5 the worst of six domains goes x1.662 -> x1.481 on SmolLM2-135M and x4.382 ->
# x2.061 on Qwen2.5-Coder-0.5B (docs/mla-models.md).
MLA_CALIBRATION_TOKENS = 6144
MLA_CALIBRATION = COMMAND_CALIBRATION.model_copy(update={"tokens": MLA_CALIBRATION_TOKENS})


def refined_share(calibration_tokens: int) -> int:
    """The calibration tokens refinement trains on when not told: the first half."""
    return calibration_tokens // 2


class MLASettings(Strict):
    """``convert --to mla``: the KV budget as a fraction, or as a latent rank plus RoPE dims."""

    to: Literal["mla"] = "mla"
    kv_budget: float | None = Field(None, gt=0, le=1)
    kv_rank: int | None = Field(None, gt=0)
    rope_dim: int | None = Field(None, ge=0)
    rope_layout: Literal["standard", "flexible"] = "standard"
    rope_fold: int | None = Field(None, ge=1)  # None: FreqFold wherever the RoPE pairs are too few for the frequencies
    format: Literal["native", "exact"] = "native"
    engine: Literal["transformers", "llama.cpp", "vllm", "sglang"] | None = None  # refuse what it would not run
    nope_width: Literal["latent", "head"] = "latent"  # head: head_dim-wide no-RoPE heads (fewer parameters)
    weighted: bool = True
    token_weights: Literal["uniform", "received"] = "uniform"  # received: the cache fitted on the attention each token receives
    refine_steps: int = Field(60, ge=0)
    refine_tokens: int | None = Field(None, gt=0)  # None: the first half of the calibration tokens
    refine_lr: float = Field(1e-3, gt=0)
    refine_schedule: Literal["constant", "cosine"] = "constant"
    short_prompts: float = Field(0.0, ge=0, lt=1)  # share of each calibration window cut into short prompts
    stream: bool = False  # one source layer in memory at a time (models larger than memory); not scored


class CompressSettings(Strict):
    """A ``compress`` step: ``method`` names the method, whose own settings class (a subclass, registered with
    the method in ``attnsurg.methods.base``) holds the rest."""

    method: str

    @classmethod
    def accepts(cls, key: str) -> bool:
        """Whether ``key`` is an input of this method's settings (a command-line option it takes)."""
        return key in cls.model_fields


class HealSettings(Strict):
    """``heal``: distill the teacher's next-token distribution (and optionally its residual stream after
    every layer, ``hidden_weight``) into the student on text.

    ``tokens`` is the training budget (optimizer steps = tokens / (seq_len x batch_size x grad_accum x
    processes)). ``train: attention`` trains only the attention modules (less any value a conversion
    holds fixed for exactness); ``all`` trains every parameter. ``teacher`` defaults to the recipe's source
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
    train: Literal["attention", "all"] = "attention"
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


# ------------------------------------------------------------------------------- requests (one command)
def check_refinement_fits(settings: MLASettings, calibration: Calibration) -> None:
    """Refinement reads the first refine_tokens of the calibration windows: a count asked for beyond them is an
    error; unset, it reads the first half of them (``refined_share``)."""
    if settings.refine_steps and settings.refine_tokens is not None and settings.refine_tokens > calibration.tokens:
        raise ValueError(
            f"refinement reads {settings.refine_tokens} tokens (refine_tokens, --refine-tokens) but calibration has "
            f"{calibration.tokens} (calibration.tokens, --calib-tokens); raise the one or lower the other"
        )


class ConvertMLA(MLASettings, SurgeryContext):
    """``attnsurg convert MODEL --to mla``: GQA/MHA to a DeepseekV3 (latent attention) checkpoint."""

    calibration: Calibration = MLA_CALIBRATION

    @model_validator(mode="after")
    def _refinement_fits(self) -> ConvertMLA:
        check_refinement_fits(self, self.calibration)
        return self


REQUEST_TYPES: dict[type, type] = {MLASettings: ConvertMLA}


def request_type(settings_type: type) -> type:
    """The request a method's settings run as: the settings plus the ``SurgeryContext``."""
    if settings_type not in REQUEST_TYPES:
        name = settings_type.__name__.removesuffix("Settings")
        REQUEST_TYPES[settings_type] = create_model(f"Compress{name}", __base__=(settings_type, SurgeryContext),
                                                    __module__=settings_type.__module__)
    return REQUEST_TYPES[settings_type]


def settings_type_of(request) -> type:
    return next(settings for settings, request_class in REQUEST_TYPES.items() if type(request) is request_class)


SurgeryRequest = SurgeryContext  # a ConvertMLA, or a method's settings with the context (``request_type``)


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


class ConvertStep(Strict):
    convert: MLASettings


class CompressStep(Strict):
    compress: Annotated[SerializeAsAny[CompressSettings], WrapValidator(compress_settings)]


class HealStep(Strict):
    heal: HealSettings


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


class Evaluation(Strict):
    """Scored after the surgery (and healing): the first ``tokens`` of the eval part of the calibration
    dataset and of each of ``domains`` (built-in texts; the calibration domain alone flatters every method),
    source and result on the same windows."""

    tokens: int = Field(2048, ge=0)
    domains: EvalDomainList = Field(default_factory=lambda: list(EVAL_DOMAINS))


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
            if isinstance(getattr(step, "convert", None), MLASettings):
                check_refinement_fits(step.convert, self.calibration)
        return self

    @property
    def surgery(self) -> MLASettings | CompressSettings | None:
        for step in self.steps:
            if isinstance(step, ConvertStep):
                return step.convert
            if isinstance(step, CompressStep):
                return step.compress
        return None

    @property
    def heal(self) -> HealSettings | None:
        return next((step.heal for step in self.steps if isinstance(step, HealStep)), None)

    def request(self, overwrite: bool = False, device: str = "auto") -> SurgeryRequest:
        """The surgery step as the request its command runs (``overwrite`` and ``device`` belong to the run,
        not to the recipe)."""
        settings = self.surgery
        if settings is None:
            raise ValueError("this recipe has no convert or compress step")
        context = dict(model=self.model, output=self.output, calibration=self.calibration,
                       eval_tokens=self.eval.tokens, eval_domains=self.eval.domains, overwrite=overwrite, seed=self.seed, device=device)
        return request_type(type(settings))(**context, **dict(settings))

    @classmethod
    def from_request(cls, request: SurgeryRequest, heal: HealSettings | None = None) -> Recipe:
        settings_type = settings_type_of(request)
        settings = settings_type(**{name: getattr(request, name) for name in settings_type.model_fields})
        step = ConvertStep(convert=settings) if settings_type is MLASettings else CompressStep(compress=settings)
        steps = [step] + ([HealStep(heal=heal)] if heal else [])
        return cls(model=request.model, output=request.output, steps=steps, calibration=request.calibration,
                   eval=Evaluation(tokens=request.eval_tokens, domains=request.eval_domains), seed=request.seed)
