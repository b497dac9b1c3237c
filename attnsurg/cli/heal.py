"""`attnsurg heal`: distil the original into an operated model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import (
    Device,
    DEFAULT_EVAL_DOMAINS,
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
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.recipe import HealSettings

HEAL = defaults_of(HealSettings)


@app.command()
@user_errors
def heal(
    model: Annotated[str, typer.Argument(help="The operated checkpoint (the student).")],
    teacher: Annotated[str, typer.Option("--teacher", help="The original model the student was made from.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Built-in dataset; its calibration part is used.")] = "wiki-sample",
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 file to train on instead (used whole).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Training tokens (the budget).")] = HEAL.tokens,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training window.")] = HEAL.seq_len,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per micro-batch (per process).")] = HEAL.batch_size,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")] = HEAL.grad_accum,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW).")] = HEAL.lr,
    schedule: Annotated[str, typer.Option("--schedule", help="cosine, linear or constant (after warmup).")] = HEAL.schedule,
    warmup: Annotated[float, typer.Option("--warmup", help="Fraction of the steps spent warming up.")] = HEAL.warmup,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="Weight of KL(teacher || student).")] = HEAL.kl_weight,
    lm_weight: Annotated[float, typer.Option("--lm-weight", help="Weight of the next-token loss.")] = HEAL.lm_weight,
    hidden_weight: Annotated[
        float, typer.Option("--hidden-weight", help="Weight of the residual-stream match after every layer (0: off).")
    ] = HEAL.hidden_weight,
    temperature: Annotated[float, typer.Option("--temperature", help="Distillation temperature.")] = HEAL.temperature,
    train: Annotated[str, typer.Option("--train", help="attention (the new or changed attention parameters) or all.")] = HEAL.train,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Held-out ppl (on --eval-tokens) every N steps (0: only at the end).")
    ] = HEAL.eval_every,
    save_every: Annotated[int, typer.Option("--save-every", help="Save resumable state every N steps.")] = HEAL.save_every,
    mixed_precision: Annotated[str, typer.Option("--mixed-precision", help="auto (bf16 on a GPU), no, bf16, fp16.")] = HEAL.mixed_precision,
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="Recompute each layer's activations in the "
                           "backward pass instead of keeping them: less memory for about a third more time.")
    ] = HEAL.gradient_checkpointing,
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", help="Tokens of the dataset's eval part (a --text file: its start) scored before/after (0: skip).")
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
    """Heal an operated model by distillation from the original (KL to its logits), with accelerate.

    Interrupted runs resume from OUTPUT.heal-state when started again with the same settings."""
    from attnsurg.recipe import (
        Calibration,
        Evaluation,
        HealStep,
        ModelRef,
        Recipe,
        TextData,
    )

    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the healed checkpoint to")
    data = TextData(text=text, part="calib") if text else TextData(dataset=dataset, part="calib")
    settings = HealSettings(
        teacher=ModelRef(ref=teacher, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        data=data, tokens=tokens, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
        schedule=schedule, warmup=warmup, kl_weight=kl_weight, lm_weight=lm_weight, hidden_weight=hidden_weight, temperature=temperature,
        train=train, eval_every=eval_every, save_every=save_every, mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        eval_tokens=eval_tokens if eval_tokens > 1 else HealSettings.model_fields["eval_tokens"].default,
    )
    recipe = Recipe(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        output=output or Path("OUT"),  # a dry run writes nothing
        steps=[HealStep(heal=settings)],
        calibration=Calibration(data=data),  # scoring reads its eval part
        eval=Evaluation(tokens=eval_tokens, domains=eval_domains_from(eval_domains)),
        seed=seed,
    )
    execute(recipe, dry_run, overwrite, print_recipe, json_output, device)
