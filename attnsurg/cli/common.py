"""What every command shares: the Typer apps, the output console, the user-error wrapper and common options."""

from __future__ import annotations

import functools
import io
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer
from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

import attnsurg
from attnsurg import ui
from attnsurg.errors import UserError
from attnsurg.requests import EVAL_DOMAINS


def defaults_of(settings: type[BaseModel]) -> SimpleNamespace:
    """A settings model's field defaults by name: a command's options default to them, so the command and a
    recipe that leaves the same fields out run alike."""
    return SimpleNamespace(**{name: field.get_default(call_default_factory=True)
                              for name, field in settings.model_fields.items() if not field.is_required()})


# Help panels: the same option sits in the same panel in every command. Rich markup keeps the newlines of the
# epilogs (one example command per line).
PLAN, CALIBRATION, TRAINING, DISTILLATION, EVALUATION, OUTPUT = (
    "Plan", "Calibration", "Training", "Distillation", "Evaluation", "Output and safety")
MARKUP = "rich"


def examples(*commands: str, guide: str | None) -> str:
    """A command's epilog: its example command lines, one per line, then the guide that documents it."""
    last = f"Guide: docs/{guide}" if guide else "Guides: docs/ (README.md lists them)."
    return "\n".join(["Examples:", *(f"  {command}" for command in commands), last])


app = typer.Typer(
    help="Attention surgery for pretrained causal language models.",
    epilog=examples("attnsurg info smollm2-135m", "attnsurg convert smollm2-135m --to mla --kv-budget 0.5 -o out/mla50",
                    "attnsurg eval perplexity smollm2-135m out/mla50 --dataset all", guide=None),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=MARKUP,
)
eval_app = typer.Typer(
    help="Measure models side by side: perplexity, zero-shot tasks, speed.", no_args_is_help=True,
    rich_markup_mode=MARKUP,
    epilog=examples("attnsurg eval perplexity smollm2-135m out/mla50 --dataset all",
                    "attnsurg eval tasks smollm2-135m out/mla50 --tasks facts,passkey",
                    "attnsurg eval speed smollm2-135m out/mla50 --context 1024", guide="eval.md"))
assets_app = typer.Typer(
    help="Built-in demo model and sample texts, fetched at run time.", rich_markup_mode=MARKUP,
    epilog=examples("attnsurg assets list", "attnsurg assets fetch smollm2-135m wiki-sample", guide="models.md"))
app.add_typer(eval_app, name="eval")
recipe_app = typer.Typer(
    help="Check recipes and list the ones that ship with attnsurg.", no_args_is_help=True, rich_markup_mode=MARKUP,
    epilog=examples("attnsurg recipe list", "attnsurg recipe validate mla-50 tucker-50", guide="recipes.md"))
app.add_typer(assets_app, name="assets")
app.add_typer(recipe_app, name="recipe")

def hide_flag_types() -> None:
    """Help shows no type for on/off flags (typer prints ``<bool>`` beside ``--help`` and every flag, though
    they take no value)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


hide_flag_types()


# Tables go to stdout, whole: piped, up to 160 columns before a table is printed at its natural width.
class TableConsole(Console):
    """stdout. On a narrow terminal rich shrinks tables' columns and cuts values short (``17.29…``, ``smoll…``);
    here a table that does not fit loses its vertical rules, then is printed at its natural width."""

    def print(self, *objects, **kwargs) -> None:
        if not any(isinstance(o, Table) for o in objects):
            super().print(*objects, **kwargs)
            return
        for o in objects:
            if isinstance(o, Table):
                self.print_table(o, **kwargs)
            else:
                super().print(o, **kwargs)

    @staticmethod
    def table_width(table: Table) -> int:
        """The table's natural width: every cell on one line."""
        return Console(width=10**4, file=io.StringIO(), markup=False).measure(table).maximum

    def print_table(self, table: Table, **kwargs) -> None:
        """Without vertical rules when the table is too wide for the terminal; wider still, printed at its
        natural width (the terminal wraps the lines) rather than with values cut."""
        if self.table_width(table) > self.width:
            table.box, table.pad_edge = box.SIMPLE_HEAD, False
        needed = self.table_width(table)
        if needed <= self.width:
            super().print(table, **kwargs)
            return
        wide = Console(file=self.file, width=needed, force_terminal=self.is_terminal, no_color=self.no_color, markup=False)
        wide.print(table, **kwargs)


out = TableConsole(markup=False) if sys.stdout.isatty() else TableConsole(width=160, markup=False)  # see ui.console


def user_errors(command):
    """Turn a UserError (or an invalid request) into one red line and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            print_error(str(exc))
            raise typer.Exit(UserError.exit_code)
        except ValidationError as exc:
            print_error(validation_message(exc))
            raise typer.Exit(UserError.exit_code)

    return wrapper


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` was given, rather than left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def print_error(message: str) -> None:
    """One red ``error:`` line on stderr; the message is never read as markup."""
    ui.console.print(Text.assemble(("error:", "bold red"), f" {message}"), highlight=False, soft_wrap=True)


CALIBRATION_FLAGS = {"tokens": "--calib-tokens", "seq_len": "--calib-seq-len", "dataset": "--calib-dataset",
                     "text": "--calib-text"}


def validation_message(exc: ValidationError) -> str:
    """The first problem, named by the option that set it (``--kv-budget``) where there is one."""
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    if len(loc) == 1 or loc[:1] == ["eval"]:  # eval.tokens is --eval-tokens
        loc = [f"--{'-'.join(loc).replace('_', '-')}"]
    where = ".".join(loc)
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def version_callback(value: bool) -> None:
    if value:
        out.print(f"attnsurg {attnsurg.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or status messages.")] = False,
) -> None:
    ui.set_quiet(quiet)
    quiet_libraries()


def quiet_libraries() -> None:
    """attnsurg shows its own progress; the libraries' tqdm bars and info logs would only add noise."""
    import logging

    import huggingface_hub.utils
    import transformers

    logging.getLogger("accelerate").setLevel(logging.ERROR)  # e.g. tied weights noted at every saved heal state
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    huggingface_hub.utils.logging.set_verbosity_error()  # retries against an unreachable hub end in one error line


TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Run code the checkpoint ships.",
                       rich_help_panel=OUTPUT)
]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help="Read pickle (.bin) weights.",
                                           rich_help_panel=OUTPUT)]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON, not a table.", rich_help_panel=OUTPUT)]
# Options every surgery command (convert, compress) shares.
CalibDataset = Annotated[str, typer.Option("--calib-dataset", help="Built-in texts (comma list) or all.",
                                           rich_help_panel=CALIBRATION)]
CalibText = Annotated[Optional[Path], typer.Option("--calib-text", help="A UTF-8 file to calibrate on instead.",
                                                   rich_help_panel=CALIBRATION)]
CalibTokens = Annotated[int, typer.Option("--calib-tokens", help="Calibration tokens.", rich_help_panel=CALIBRATION)]
CalibSeqLen = Annotated[
    int, typer.Option("--calib-seq-len", help="Tokens per calibration window.", rich_help_panel=CALIBRATION)
]
EvalTokens = Annotated[int, typer.Option("--eval-tokens", help="Tokens scored before and after (0: skip).",
                                         rich_help_panel=EVALUATION)]
EvalDomains = Annotated[
    str,
    typer.Option("--eval-domains", help="Texts also scored: list, all or none.", rich_help_panel=EVALUATION,
                 show_default=",".join(d.removesuffix("-sample") for d in EVAL_DOMAINS)),
]
DEFAULT_EVAL_DOMAINS = ",".join(EVAL_DOMAINS)
EvalLong = Annotated[int, typer.Option("--eval-long", help="Retrieval, late ppl at N tokens too.",
                                       rich_help_panel=EVALUATION, show_default=False)]
EvalDType = Annotated[str, typer.Option("--dtype", help="auto (CPU: fp32), float32, bfloat16, float16.",
                                        rich_help_panel=OUTPUT)]
EvalDevice = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.", rich_help_panel=OUTPUT)]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan, write nothing.", rich_help_panel=OUTPUT)]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an earlier attnsurg output.",
                                         rich_help_panel=OUTPUT)]
Seed = Annotated[int, typer.Option("--seed", help="Random seed.", rich_help_panel=OUTPUT)]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.",
                                     rich_help_panel=OUTPUT)]
PrintRecipe = Annotated[
    bool, typer.Option("--print-recipe", help="Print the command as a recipe.", rich_help_panel=OUTPUT)
]


def calibration_from(dataset: str, text: Path | None, tokens: int, seq_len: int):
    """The Calibration request the --calib-* options describe (always the calibration part)."""
    from attnsurg.requests import Calibration, TextData

    try:
        data = TextData(text=text, part="calib") if text else TextData(dataset=dataset, part="calib")
        return Calibration(data=data, tokens=tokens, seq_len=seq_len)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a check across fields names its flags itself
            raise UserError(message) from None
        field = str(first["loc"][0])
        raise UserError(f"{CALIBRATION_FLAGS.get(field, field)}: {message}") from None


def eval_domains_from(value: str) -> list[str]:
    """The --eval-domains list: built-in domain names, 'all', or 'none'."""
    from attnsurg.data import DOMAINS, parse_datasets

    if value.strip().lower() == "none":
        return []
    names = parse_datasets(value)
    others = [n for n in names if n not in DOMAINS]
    if others:
        raise UserError(f"--eval-domains takes built-in samples ({', '.join(DOMAINS)}), all or none, not '{others[0]}'")
    return names
