"""`attnsurg generate`: a prompt in, the model's tokens streamed out, its speed and cache at the end."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from attnsurg.cli.common import (
    EVALUATION,
    OUTPUT,
    AllowPickle,
    EvalDevice,
    EvalDType,
    JsonFlag,
    TrustRemoteCode,
    app,
    examples,
    user_errors,
)
from attnsurg.errors import UserError

RuntimeOption = Annotated[str, typer.Option(
    "--runtime", help="attnsurg (latent attention) or stock (transformers').",
    rich_help_panel=EVALUATION)]


@app.command(epilog=examples(
    'attnsurg generate out/mla50 --prompt "What is the capital of France?"',
    'attnsurg generate out/mla50 --prompt "def fib(n):" --max-new-tokens 64',
    guide="serving.md"))
@user_errors
def generate(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")],
    prompt: Annotated[str, typer.Option("--prompt", help="The prompt, or - to read it from stdin.",
                                        rich_help_panel=EVALUATION)] = "",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate.",
                                                rich_help_panel=EVALUATION)] = 128,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap the prompt in the tokenizer's chat template.",
                                       rich_help_panel=EVALUATION)] = True,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature (0 decodes greedily).",
                                               rich_help_panel=EVALUATION)] = 0.0,
    runtime: RuntimeOption = "attnsurg",
    dtype: EvalDType = "auto",
    device: EvalDevice = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Random seed when sampling.", rich_help_panel=OUTPUT)] = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Generate from a prompt, streamed; then tokens/s and the KV cache held."""
    from attnsurg.generate import run_generate
    from attnsurg.requests import GenerateRequest, ModelRef

    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise UserError("the prompt is empty; pass --prompt TEXT (or --prompt - to read it from stdin)")
    request = GenerateRequest(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        prompt=text, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature, runtime=runtime,
        dtype=dtype, device=device, seed=seed,
    )
    stream = None if json_output else (lambda piece: print(piece, end="", flush=True))
    report = run_generate(request, stream or (lambda piece: None))
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
        return
    print()
    from attnsurg import ui

    ui.console.print(
        f"{report.prompt_tokens} prompt tokens, {report.new_tokens} new ({report.stopped}); "
        f"first token after {report.prefill_seconds:.2f} s, then {report.decode_tokens_per_second:.1f} tokens/s; "
        f"KV cache {report.kv_cache_bytes / 2**20:.2f} MiB ({report.kv_bytes_per_token:,.0f} B/token); "
        f"runtime {report.runtime}")
