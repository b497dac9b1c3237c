"""``attnsurg info``: a model's attention anatomy, read from its config without loading weights."""

from __future__ import annotations

from typing import Any

from attnsurg.arch.anatomy import inspect_config
from attnsurg.io.load import load_config, resolve_source
from attnsurg.methods import method_support
from attnsurg.recipe import InfoRequest


def describe(request: InfoRequest) -> dict[str, Any]:
    ref = request.model
    source = resolve_source(ref.ref, ref.allow_pickle, ref.trust_remote_code)
    config = load_config(source, ref.trust_remote_code)
    anatomy = inspect_config(config, ref.trust_remote_code)
    return {"model": ref.ref, "source": source.kind, "anatomy": anatomy.to_dict(), "methods": method_support(anatomy)}
