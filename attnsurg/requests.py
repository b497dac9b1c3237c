"""Typed requests: every command builds one of these (``recipe.py`` holds the surgery settings and the recipe
grammar built on them), and the vocabulary they share: a model reference, a text and a calibration.

Method code receives these objects (or plain values taken from them) and never reads CLI state.
Unknown keys are rejected so a typo in a recipe is an error, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from attnsurg.errors import UserError

DType = Literal["auto", "float32", "bfloat16", "float16"]
Runtime = Literal["attnsurg", "stock"]  # how a DeepseekV3 model attends at inference: absorbed, or transformers' own


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no NaN or infinite setting


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
        if text is None:
            return text
        path = Path(text).expanduser()
        if path.is_dir():
            raise ValueError(f"'{text}' is a directory; give a UTF-8 text file")
        if path.exists() and not path.is_file():
            raise ValueError(f"'{text}' is not a regular file (a device or a pipe); give a UTF-8 text file")
        if not path.exists():
            raise ValueError(f"text file '{text}' does not exist")
        return text

    def datasets(self) -> list[str]:
        """The built-in datasets named (``all`` expanded), in order; empty for a user's file."""
        from attnsurg.data import parse_datasets

        return parse_datasets(self.dataset) if self.dataset and self.text is None else []

    def described(self) -> str:
        """The text in words: a file, a dataset, or several datasets taking windows in turn."""
        if self.text is not None:
            return str(self.text)
        names = self.datasets()
        return names[0] if len(names) == 1 else f"{', '.join(names)} (windows in turn)"

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
    by_position: bool = False  # also the ppl of the tokens at positions 0-512, 512-1K, 1K-2K, ... of each window
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


TASK_NAMES = ("facts", "cloze", "passkey", "retrieval")
DEFAULT_TASKS = ("facts", "cloze", "passkey")  # retrieval takes minutes a model: asked for by name
RETRIEVAL_VARIANTS = ("multikey", "single", "multivalue", "tracking")


class TasksEval(Strict):
    """``attnsurg eval tasks``: zero-shot tasks scored the way lm-evaluation-harness scores them, every model
    on the same items."""

    models: list[ModelRef] = Field(min_length=1)
    tasks: list[Literal["facts", "cloze", "passkey", "retrieval"]] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    lm_eval: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks, run by the harness.")
    lm_eval_include: Path | None = Field(None, description="A folder of extra lm-evaluation-harness task YAML files.")
    limit: int | None = Field(None, gt=0, description="At most this many items per task (facts, cloze, lm-eval).")
    cloze_items: int = Field(300, gt=0)
    passkey_lengths: list[int] | None = None
    retrieval_lengths: list[int] | None = None  # None: 1024, 2048, ... and the model's whole context
    retrieval_questions: int = Field(80, gt=0, description="Questions per length and variant.")
    retrieval_variants: list[Literal["multikey", "single", "multivalue", "tracking"]] = Field(
        default_factory=lambda: ["multikey"], min_length=1)
    max_length: int = Field(2048, gt=1, description="Longest input for log-likelihood items (left-truncated).")
    dtype: DType = "auto"
    device: str = "auto"

    @model_validator(mode="after")
    def _something_to_run(self) -> TasksEval:
        if not self.tasks and not self.lm_eval:
            raise ValueError("no task to run: name built-in tasks (facts, cloze, passkey, retrieval) or "
                             "lm-evaluation-harness tasks")
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
