"""Whether a redesign changed what the shipped recipes write: each recipe run on this tree (no scoring), its
tensors compared with a reference checkpoint of the same recipe (one written by another commit).

    python benchmarks/same_tensors.py RECIPE REFERENCE_DIR [--out-dir out/same] [--set convert.nope_width=latent]

``--set`` overrides one setting of the recipe's surgery step (a default that changed on purpose since the
reference was written). Prints and writes results/same_tensors-RECIPE.json: how many tensors, how many differ
and by how much at most.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors import safe_open

from attnsurg.io.recipe_file import load_recipe
from attnsurg.pipelines.run import run_recipe
from attnsurg.recipe import Evaluation
from common import write_result


def tensors(directory: Path) -> dict:
    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found |= {name: f.get_tensor(name) for name in f.keys()}
    return found


def overridden(recipe, assignments: list[str]):
    """The recipe with ``step.field=value`` assignments applied to its surgery step."""
    step = recipe.steps[0]
    for assignment in assignments:
        path, value = assignment.split("=", 1)
        kind, name = path.split(".", 1)
        settings = getattr(step, kind)
        step = step.model_copy(update={kind: type(settings).model_validate({**settings.model_dump(), name: value})})
    return recipe.model_copy(update={"steps": [step, *recipe.steps[1:]]})


def compared(written: dict, reference: dict) -> dict:
    if written.keys() != reference.keys():
        return {"same_names": False, "only_here": sorted(written.keys() - reference.keys()),
                "only_in_reference": sorted(reference.keys() - written.keys())}
    different = {name: float((written[name].double() - reference[name].double()).abs().max())
                 for name in written
                 if written[name].shape != reference[name].shape or not bool((written[name] == reference[name]).all())}
    return {"same_names": True, "tensors": len(written), "different": len(different),
            "max_abs_difference": max(different.values(), default=0.0), "largest": dict(sorted(different.items(),
                                                                                                  key=lambda kv: -kv[1])[:5])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("reference", type=Path)
    parser.add_argument("--out-dir", type=Path, default=Path("out/same"))
    parser.add_argument("--set", action="append", default=[], dest="assignments")
    args = parser.parse_args()
    output = args.out_dir / args.recipe
    recipe = overridden(load_recipe(Path(args.recipe)), args.assignments)
    run_recipe(recipe.model_copy(update={"output": output, "eval": Evaluation(tokens=0, domains=[])}), overwrite=True)
    result = {"recipe": args.recipe, "reference": str(args.reference), "set": args.assignments,
              **compared(tensors(output), tensors(args.reference))}
    print(result)
    write_result(f"same_tensors-{args.recipe}", result)


if __name__ == "__main__":
    main()
