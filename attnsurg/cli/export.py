"""`attnsurg export`: a checkpoint in another engine's file format (GGUF for llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import OUTPUT, JsonFlag, app, examples, out, user_errors
from attnsurg.errors import UserError


@app.command(epilog=examples("attnsurg export out/mla50 --gguf out/mla50.gguf",
                             "attnsurg export smollm2-135m --gguf out/smollm2.gguf --dtype f16", guide="serving.md"))
@user_errors
def export(
    model: Annotated[str, typer.Argument(help="An MLA conversion (native) or a Llama/Mistral model.")],
    gguf: Annotated[Optional[Path], typer.Option("--gguf", help="The GGUF file to write (llama.cpp).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (the checkpoint's), f32, f16 or bf16.",
                                       rich_help_panel=OUTPUT)] = "auto",
    tokenizer_pre: Annotated[
        Optional[str], typer.Option("--tokenizer-pre", help="llama.cpp pre-tokenizer name, if not recognised.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.",
                                            rich_help_panel=OUTPUT)] = False,
    json_output: JsonFlag = False,
) -> None:
    """Write a checkpoint as GGUF for llama.cpp (MLA as DeepSeek2)."""
    from attnsurg.io.gguf_export import export_gguf

    if gguf is None:
        raise UserError("missing --gguf OUT.gguf: the file to write")
    result = export_gguf(model, gguf, dtype, tokenizer_pre, overwrite)
    record = {"written": str(result.path), "architecture": result.architecture, "tensors": result.tensors,
              "bytes": result.bytes}
    if json_output:
        print(json.dumps(record, indent=2))
        return
    out.print(f"wrote {result.path} ({result.architecture}, {result.tensors} tensors, {result.bytes / 2**20:,.1f} MiB)")
