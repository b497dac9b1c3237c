"""`attnsurg heal`: distil the original into an operated model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import (
    DEFAULT_EVAL_DOMAINS,
    given_on_command_line,
    DISTILLATION,
    EVALUATION,
    TRAINING,
    Device,
    AllowPickle,
    DryRun,
    EvalDomains,
    JsonFlag,
    Overwrite,
    PrintRecipe,
    Seed,
    TrustRemoteCode,
    app,
    defaults_of,
    eval_domains_from,
    examples,
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.recipe import HealSettings

HEAL = defaults_of(HealSettings)


@app.command(epilog=examples(
    "attnsurg heal out/mla50 --teacher smollm2-135m -o out/mla50-healed",
    "attnsurg heal out/mla50 --teacher smollm2-135m --tokens 100000 --dry-run",
    "attnsurg heal out/lin64 --teacher smollm2-135m --train lora -o out/healed",
    guide="heal.md"))
@user_errors
def heal(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The operated checkpoint (the student).")],
    teacher: Annotated[str, typer.Option("--teacher", help="The original model the student was made from.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Built-in text to train on.",
                                         rich_help_panel=TRAINING)] = "wiki-sample",
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 file to train on (all of it).",
                                                 rich_help_panel=TRAINING)] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Training tokens (the budget).",
                                        rich_help_panel=TRAINING)] = HEAL.tokens,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training window.",
                                         rich_help_panel=TRAINING)] = HEAL.seq_len,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per micro-batch.",
                                            rich_help_panel=TRAINING)] = HEAL.batch_size,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.",
                                            rich_help_panel=TRAINING)] = HEAL.grad_accum,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW).", rich_help_panel=TRAINING)] = HEAL.lr,
    schedule: Annotated[str, typer.Option("--schedule", help="cosine, linear or constant.",
                                          rich_help_panel=TRAINING)] = HEAL.schedule,
    warmup: Annotated[float, typer.Option("--warmup", help="Share of steps warming up.",
                                          rich_help_panel=TRAINING)] = HEAL.warmup,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="Weight of KL(teacher || student).",
                                             rich_help_panel=DISTILLATION)] = HEAL.kl_weight,
    lm_weight: Annotated[float, typer.Option("--lm-weight", help="Weight of the next-token loss.",
                                             rich_help_panel=DISTILLATION)] = HEAL.lm_weight,
    hidden_weight: Annotated[
        float, typer.Option("--hidden-weight", help="Weight of the per-layer match.",
                            rich_help_panel=DISTILLATION)
    ] = HEAL.hidden_weight,
    temperature: Annotated[float, typer.Option("--temperature", help="Distillation temperature.",
                                               rich_help_panel=DISTILLATION)] = HEAL.temperature,
    train: Annotated[str, typer.Option("--train", help="attention, all, lora or features.",
                                       rich_help_panel=TRAINING)] = HEAL.train,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="Adapter rank (--train lora).",
                                           rich_help_panel=TRAINING)] = HEAL.lora_rank,
    lora_alpha: Annotated[Optional[float], typer.Option("--lora-alpha", help="Adapter scale numerator (default 2 x rank).",
                                                        hidden=True)] = None,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Held-out ppl every N steps (0: end).",
                          rich_help_panel=EVALUATION)
    ] = HEAL.eval_every,
    save_every: Annotated[int, typer.Option("--save-every", help="Save resumable state every N steps.",
                                            rich_help_panel=TRAINING)] = HEAL.save_every,
    mixed_precision: Annotated[str, typer.Option("--mixed-precision", help="auto, no, bf16 or fp16.",
                                                 rich_help_panel=TRAINING)] = HEAL.mixed_precision,
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="Recompute activations: less memory, ~1/3 slower.",
                           rich_help_panel=TRAINING)
    ] = HEAL.gradient_checkpointing,
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", help="Tokens scored before and after (0: skip).",
                          rich_help_panel=EVALUATION)
    ] = HEAL.eval_tokens,
    eval_domains: EvalDomains = DEFAULT_EVAL_DOMAINS,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    device: Device = "auto",
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Heal an operated model by distillation from the original (resumable)."""
    from attnsurg.recipe import HealStep, Recipe
    from attnsurg.requests import Calibration, ModelRef, TextData

    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the healed checkpoint to")
    data = TextData(text=text, part="calib") if text else TextData(dataset=dataset, part="calib")
    given_seq_len = {"seq_len": seq_len} if given_on_command_line(ctx, "seq_len") else {}  # the default fits the context
    settings = HealSettings(
        teacher=ModelRef(ref=teacher, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        data=data, tokens=tokens, **given_seq_len, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
        schedule=schedule, warmup=warmup, kl_weight=kl_weight, lm_weight=lm_weight, hidden_weight=hidden_weight, temperature=temperature,
        train=train, lora_rank=lora_rank, lora_alpha=lora_alpha, eval_every=eval_every, save_every=save_every, mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        eval_tokens=eval_tokens if eval_tokens > 1 else HealSettings.model_fields["eval_tokens"].default,
    )
    recipe = Recipe(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        output=output or Path("OUT"),  # a dry run writes nothing
        steps=[HealStep(heal=settings)],
        calibration=Calibration(data=data),  # scoring reads its eval part
        eval={"tokens": eval_tokens, "domains": eval_domains_from(eval_domains)},
        seed=seed,
    )
    execute(recipe, dry_run, overwrite, print_recipe, json_output, device)
