"""`attnsurg export`: a checkpoint in another engine's file format (GGUF for llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import JsonFlag, app, out, user_errors
from attnsurg.errors import UserError


@app.command()
@user_errors
def export(
    model: Annotated[str, typer.Argument(help="Checkpoint directory or built-in name: an MLA conversion (native format) "
                                              "or an unmodified Llama/Mistral model.")],
    gguf: Annotated[Optional[Path], typer.Option("--gguf", help="The GGUF file to write (llama.cpp).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (the checkpoint's), f32, f16 or bf16; norms stay f32.")] = "auto",
    tokenizer_pre: Annotated[
        Optional[str], typer.Option("--tokenizer-pre", help="llama.cpp's pre-tokenizer name, when it is not recognised.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.")] = False,
    json_output: JsonFlag = False,
) -> None:
    """Write a checkpoint as GGUF for llama.cpp (MLA conversions as DeepSeek2, latent attention kept)."""
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
