"""docs/results.md and README's results table, generated from the quality-matrix and long-context files in
docs/results/.

    python benchmarks/results_doc.py [--check]

To publish a run of `benchmarks/quality_matrix.py` or `benchmarks/long_context.py`, copy its
benchmarks/results/quality_matrix*.json or long_context*.json into docs/results/ and run this. ``--check`` writes nothing and exits 1 when docs/results.md or README's table differ
from what the files give (a test runs it, so no figure in either drifts from its file).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- results:start -->\n).*?(<!-- results:end -->)", re.S)
DEMO = "smollm2-135m"
MIN_REFERENCE_ACCURACY = 0.05  # below it the original answers too few items for a share of them to mean anything


def short(domain: str) -> str:
    return domain.removesuffix("-sample")


def matrix_table(rows: list[dict], settings: dict) -> str:
    """One model's matrix: perplexity ratio per domain, the worst, facts (share kept), cloze, passkey."""
    domains = list(rows[0]["ratios"])
    tasks = bool(settings["tasks"])
    header = ["recipe", "KV B/token"] + [short(d) for d in domains] + ["worst"]
    if tasks:
        header += ["facts 4-way (kept)", "facts greedy (kept)", "cloze acc", "passkey by length"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        if "refused" in row:
            lines.append(f"| {row['name']} | refused: {row['refused']} |")
            continue
        cells = [row["name"], f"{row['kv_bytes_per_token']:,}"] + [f"x{row['ratios'][d]:.3f}" for d in domains]
        cells.append("-" if row["name"] == "original" else f"x{row['ratios'][row['worst']]:.3f} {short(row['worst'])}")
        if tasks:
            cells += [facts_cell(value, share, reference)
                      for value, share, reference in zip(row["facts"], row["facts_kept"], rows[0]["facts"])]
            cells += [f"{row['cloze_acc']:.3f}", " / ".join(f"{acc:.1f}" for acc in row["passkey"].values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def facts_cell(accuracy: float, kept: float, reference_accuracy: float) -> str:
    """Accuracy, and in brackets the share of the original's right answers kept (n/a when the original gets
    under MIN_REFERENCE_ACCURACY of the items right)."""
    return f"{accuracy:.3f} ({'n/a' if reference_accuracy < MIN_REFERENCE_ACCURACY else f'{kept:.3f}'})"


def matrix_note(rows: list[dict], settings: dict) -> str:
    passkey = ", ".join(rows[0]["passkey"]) if settings["tasks"] else "-"
    original = ", ".join(f"{short(d)} {p:.3f}" for d, p in rows[0]["ppl"].items())
    return (f"Perplexity ratios on the first {settings['windows']} x 1024 tokens of each domain's evaluation part, "
            f"fp32, CPU; passkey lengths {passkey}; the original's perplexity: {original}.")


def long_context_table(rows: list[dict]) -> str:
    """Retrieval (rate ± standard error, and the share of the original's hits kept) per length, then the
    perplexity ratio to the original per position band."""
    reference = next(row for row in rows if "retrieval" in row)
    lengths, bands = list(reference["retrieval"]), list(reference["ppl_ratio_by_position"])
    header = ["recipe"] + [f"retrieval {tokens(n)} (kept)" for n in lengths] + [f"ppl {band}" for band in bands]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        if "refused" in row:
            lines.append(f"| {row['name']} | refused: {row['refused']} |")
            continue
        cells = [row["name"]]
        cells += [f"{row['retrieval'][n]:.2f} ± {row['retrieval_stderr'][n]:.2f} ({kept(row['retrieval_kept'][n])})"
                  for n in lengths]
        cells += [f"x{row['ppl_ratio_by_position'][band]:.3f}" for band in bands]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_context_note(run: dict) -> str:
    settings = run["settings"]
    return (f"Retrieval: multikey (16 needles a haystack, each asked in turn with the others as distractors), "
            f"{settings['questions']} questions a length, greedy; kept: the share of the original's hits still "
            f"answered. Perplexity by position: {settings['ppl_windows']} x {settings['ppl_length']} tokens of "
            f"{settings['ppl_text']}'s evaluation part, each band's perplexity as a ratio to the original's "
            f"(the model's context: {run['context']:,} tokens).")


def tokens(length: str | int) -> str:
    n = int(length)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def kept(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{share:.2f}"  # nan: the original answered none


def provenance_line(origin: dict) -> str:
    commit = (origin.get("commit") or "unknown")[:10]
    dirty = " (with uncommitted changes)" if origin.get("uncommitted_changes") else ""
    versions = origin.get("versions", {})
    machine = origin.get("machine", {})
    return (f"Run at commit `{commit}`{dirty}, {origin.get('date', '?')[:10]}; torch {versions.get('torch')}, "
            f"transformers {versions.get('transformers')}; {machine.get('cores')} cores, "
            f"{machine.get('torch_threads')} torch threads, {machine.get('device')}.")


def load_runs(folder: Path = RESULTS, kind: str = "quality_matrix") -> list[dict]:
    """The runs of one benchmark (``quality_matrix`` or ``long_context``), the demo model first."""
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob(f"{kind}*.json"))]
    return sorted(runs, key=lambda run: (run["model"] != DEMO, run["model"]))


def long_context_section(run: dict) -> list[str]:
    command = "python benchmarks/long_context.py" + ("" if run["model"] == DEMO else f" --model {run['model']}")
    return ["### Long context", "", f"`{command}`. {provenance_line(run['provenance'])}", "",
            long_context_table(run["rows"]), "", long_context_note(run), ""]


def results_doc(runs: list[dict], long_runs: list[dict] = ()) -> str:
    parts = ["# Results", "",
             "Every shipped recipe on each real model, scored by `benchmarks/quality_matrix.py` (generated by",
             "`python benchmarks/results_doc.py` from the files in `docs/results/`; do not edit by hand).",
             "Facts: accuracy on 388 country facts, with the share of the original's right answers kept in brackets",
             f"(n/a where the original gets under {MIN_REFERENCE_ACCURACY:.0%} of them right).", ""]
    for run in runs:
        command = "python benchmarks/quality_matrix.py" + ("" if run["model"] == DEMO else f" --model {run['model']}")
        parts += [f"## {run['model']}", "", f"`{command}`. {provenance_line(run['provenance'])}", "",
                  matrix_table(run["rows"], run["settings"]), "", matrix_note(run["rows"], run["settings"]), ""]
        parts += [f"Rows {', '.join(names)}: {provenance_line(origin)}\n" for origin, names in earlier_runs(run)]
        parts += next((long_context_section(long) for long in long_runs if long["model"] == run["model"]), [])
    return "\n".join(parts)


def earlier_runs(run: dict) -> list[tuple[dict, list[str]]]:
    """The rows kept from earlier runs (``quality_matrix.py --update``), grouped by the run that made them."""
    groups: dict[str, tuple[dict, list[str]]] = {}
    for row in run["rows"]:
        if "provenance" in row:
            groups.setdefault(json.dumps(row["provenance"], sort_keys=True), (row["provenance"], []))[1].append(row["name"])
    return list(groups.values())


def summary_cell(row: dict | None, original: dict, long: dict | None) -> str:
    if row is None:
        return "not run"
    if "refused" in row:
        return "refused"
    kv = row["kv_bytes_per_token"] / original["kv_bytes_per_token"]
    facts = f" · {row['facts_kept'][0]:.2f}" if "facts_kept" in row else ""
    cell = f"x{kv:.2f} · x{row['ratios'][row['worst']]:.2f} {short(row['worst'])}{facts}"
    if long is not None:
        longest = next((r for r in long["rows"] if r["name"] == row["name"] and "retrieval_kept" in r), None)
        cell += " · " + ("-" if longest is None else kept(list(longest["retrieval_kept"].values())[-1]))
    return cell


def summary_header(run: dict, long: dict | None) -> str:
    header = f"{run['model']}: KV · worst · facts kept"
    return header if long is None else f"{header} · retrieval kept at {tokens(long['settings']['lengths'][-1])}"


def summary_table(runs: list[dict], long_runs: list[dict] = ()) -> str:
    """README's table: per recipe and model, the KV cache ratio, the worst domain, the facts kept and, where the
    model has a long-context run, the original's retrieval hits kept at its longest length."""
    longs = [next((long for long in long_runs if long["model"] == run["model"]), None) for run in runs]
    names = list(dict.fromkeys(row["name"] for run in runs for row in run["rows"] if row["name"] != "original"))
    lines = ["| recipe | " + " | ".join(summary_header(run, long) for run, long in zip(runs, longs)) + " |",
             "|---" * (len(runs) + 1) + "|"]
    for name in names:
        cells = [summary_cell(next((r for r in run["rows"] if r["name"] == name), None), run["rows"][0], long)
                 for run, long in zip(runs, longs)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_summary(readme: str, runs: list[dict], long_runs: list[dict] = ()) -> str:
    if not BLOCK.search(readme):
        raise SystemExit("README.md has no <!-- results:start --> ... <!-- results:end --> block")
    return BLOCK.sub(lambda m: m.group(1) + summary_table(runs, long_runs) + "\n" + m.group(2), readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args()
    runs, long_runs = load_runs(), load_runs(kind="long_context")
    wanted = {DOC: results_doc(runs, long_runs), README: with_summary(README.read_text(), runs, long_runs)}
    stale = [path.name for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        if stale:
            sys.exit(f"out of date with docs/results/: {', '.join(stale)} (run python benchmarks/results_doc.py)")
        return
    for path, text in wanted.items():
        path.write_text(text)


if __name__ == "__main__":
    main()
