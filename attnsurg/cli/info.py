"""`attnsurg info`: the attention anatomy of a model."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from attnsurg.cli.common import (
    AllowPickle,
    JsonFlag,
    TrustRemoteCode,
    app,
    examples,
    out,
    user_errors,
)
from attnsurg.errors import UserError


@app.command(epilog=examples("attnsurg info smollm2-135m", "attnsurg info smollm2-135m --json",
                             "attnsurg info --methods", guide="models.md"))
@user_errors
def info(
    model: Annotated[str | None, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")] = None,
    methods: Annotated[bool, typer.Option("--methods", help="Print the method support matrix (no MODEL needed).")] = False,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """A model's attention anatomy and the methods that support it."""
    from attnsurg.info import describe
    from attnsurg.requests import InfoRequest, ModelRef

    if methods:
        print_support_matrix(json_output)
        return
    if model is None:
        raise UserError("missing MODEL: a checkpoint directory, .gguf file, hub id or built-in name (or --methods)")

    request = InfoRequest(model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle))
    record = describe(request)
    if json_output:
        print(json.dumps(record, indent=2))
    else:
        out.print(info_table(record))


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def info_table(record: dict) -> Table:
    a = record["anatomy"]
    table = Table(title=f"{record['model']}: attention anatomy", show_header=False, title_justify="left")
    table.add_column("property", style="bold")
    table.add_column("value")
    rows = [
        ("family (model_type)", Text(a["model_type"]) if a["family"] else Text.assemble(a["model_type"], ("  (no surgery support)", "yellow"))),
        ("attention", a["attention_kind"].upper()),
        ("layers", str(a["num_layers"])),
        ("hidden size", str(a["hidden_size"])),
        ("query heads", str(a["num_heads"])),
        ("KV heads", str(a["num_kv_heads"])),
        ("head dim", str(a["head_dim"])),
    ]
    if a["mla"]:
        rows += [(k.replace("_", " "), str(v)) for k, v in a["mla"].items()]
    rope = f"{a['rope_type']}, theta {a['rope_theta']:g}" if a["rope_theta"] is not None else "none"
    biases = ", ".join(n for n in "qkvo" if a[f"{n}_bias"]) or "none"
    window = f"{a['sliding_window']} tokens on {a['sliding_layers']} layers" if a["sliding_window"] else "none"
    attn_share = a["attention_parameters"] / a["total_parameters"]
    rows += [
        ("RoPE", rope),
        ("biases", biases),
        ("q/k norms", _yes_no(a["qk_norm"])),
        ("fused q/k/v projection", _yes_no(a["fused_qkv"])),
        ("attention soft-capping", f"{a['logit_softcap']:g}" if a["logit_softcap"] else "none"),
        ("sliding window", window),
        ("max positions", str(a["max_positions"])),
        ("tied embeddings", _yes_no(a["tied_embeddings"])),
        ("parameters (attention / total)", f"{a['attention_parameters']:,} / {a['total_parameters']:,} ({attn_share:.1%})"),
        ("KV values per token", f"{a['kv_values_per_token']:,} ("
         + ("mean " if len(set(a["kv_layer_values"])) > 1 else "") + f"{a['kv_values_per_layer']} per layer)"),
        (f"KV bytes per token ({a['dtype']})", f"{a['kv_bytes_per_token']:,}"),
        ("methods", methods_cell(record["methods"])),
    ]
    if a["dtype"] != "bfloat16":
        rows.insert(-1, ("KV bytes per token (bfloat16)", f"{a['kv_bytes_per_token_bf16']:,}"))
    if a["surgery"]:
        rows.insert(-1, ("surgery", surgery_cell(a["surgery"])))
    for name, value in rows:
        table.add_row(name, value)
    return table


def headline_rank(value) -> int:
    """One number per record entry: a rank, the sum of cached k/v ranks, or a tensor's hidden rank."""
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return sum(value)
    return value["rank"] if "rank" in value else value["ranks"][-1]


def surgery_cell(surgery: dict) -> str:
    """What attnsurg did to a checkpoint it wrote: method and the spread of ranks."""
    lines = [f"{surgery.get('method', '?')}" + (", consumer-weighted" if surgery.get("weighted") else "")]
    for key, label in (("low_rank", "low-rank projections"), ("kv_latent", "k/v latent layers"),
                       ("head_tensor", "tensor-decomposed projections"), ("factored_kv", "layers caching k/v factors"),
                       ("stacked_tucker", "stacked Tucker layers")):
        ranks = [headline_rank(value) for value in (surgery.get(key) or {}).values()]
        if ranks:
            spread = str(ranks[0]) if min(ranks) == max(ranks) else f"{min(ranks)}-{max(ranks)}"
            lines.append(f"{len(ranks)} {label}, rank {spread}")
    if linear := surgery.get("linear"):
        lines.append(f"softmax over the last {linear['window']} keys and the first {linear.get('sinks', 0)}, "
                     f"{linear.get('feature_map', 'hedgehog')} feature maps 2 x {linear['feature_dim']} beyond; "
                     "the cache stops growing past the window")
        if full := linear.get("full_layers"):
            lines.append(f"layers {','.join(map(str, full))} keep softmax attention over the whole context")
    return "\n".join(lines)


def methods_cell(methods: dict[str, str | None]) -> str | Text:
    if not methods:
        return "none installed"
    lines = [Text.assemble(f"{n}: ", ("yes", "green")) if why is None else Text.assemble(f"{n}: ", ("no", "yellow"), f" ({why})")
             for n, why in methods.items()]
    return Text("\n").join(lines)


def footnote(notes: dict, method: str, value: str) -> str:
    """The footnote mark of a qualified cell ("*", "**", ...), adding the note the first time it is seen."""
    keys = [k for k in notes if k.startswith("*")]
    for key in keys:
        if key.split(" ", 1)[1] == f"{method}: {value}":
            return key.split(" ", 1)[0]
    mark = "*" * (len(keys) + 1)
    notes[f"{mark} {method}: {value}"] = []
    return mark


def print_support_matrix(json_output: bool) -> None:
    from attnsurg.arch.coverage import support_matrix

    matrix = support_matrix()
    if json_output:
        print(json.dumps(matrix, indent=2))
        return
    methods = list(next(iter(matrix.values())))
    table = Table(title="What each method does with each family at full budget (exact: reproduces the logits)",
                  title_justify="left")
    table.add_column("family")
    for name in methods:
        table.add_column(name)
    notes = {}
    for family, row in matrix.items():
        cells = []
        for name in methods:
            value = row[name]
            if value.startswith("refused: "):
                refusing = notes.setdefault(value.removeprefix("refused: "), [])
                if name not in refusing:
                    refusing.append(name)
                cells.append("refused")
            else:
                label = "exact" if value.startswith("exact") else "fitted"
                cells.append(label + ("" if value == "exact" else footnote(notes, name, value)))
        table.add_row(family, *cells)
    out.print(table)
    for note, refusing in notes.items():
        out.print(note if not refusing else f"{', '.join(refusing)}: {note}", highlight=False)
