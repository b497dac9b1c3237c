"""The layerwise run: every registered method, streamed from the checkpoint and operated on the loaded model,
writes the same tensors (one loop drives both, ``methods.layerwise``)."""

from __future__ import annotations

import pytest
import torch

from attnsurg.methods import catalog

from helpers import streamed_and_loaded

# Small settings for each method's run on the tiny GQA Llama (64-token windows).
RUNS = {
    "mla": ["convert", "--to", "mla", "--kv-budget", "0.5", "--refine-steps", "5"],
    "linear": ["convert", "--to", "linear", "--window", "8", "--transfer-steps", "5"],
    "svd": ["compress", "--method", "svd", "--ratio", "0.5"],
    "asvd": ["compress", "--method", "asvd", "--ratio", "0.5"],
    "svdllm": ["compress", "--method", "svdllm", "--ratio", "0.5", "--targets", "k,v", "--kv-latent"],
    "tucker": ["compress", "--method", "tucker", "--ratio", "0.5", "--allocate"],
    "cp": ["compress", "--method", "cp", "--ranks", "4"],
    "loki": ["compress", "--method", "loki", "--rank", "8", "--top-k", "16"],
    "topk": ["compress", "--method", "topk", "--top-k", "0.5"],
}


def test_every_registered_method_is_run_both_ways():
    assert set(RUNS) == set(catalog.names("convert")) | set(catalog.names("compress"))


@pytest.mark.parametrize("method", sorted(RUNS))
def test_streamed_and_loaded_runs_write_the_same_tensors(method, tiny_checkpoints, corpus_file, tmp_path):
    command, *options = RUNS[method]
    common = [command, str(tiny_checkpoints["llama-gqa"]), *options, "--calib-text", str(corpus_file),
              "--calib-tokens", "768", "--calib-seq-len", "64", "--eval-domains", "none", "--json"]
    _, tensors = streamed_and_loaded(common, tmp_path)
    streamed, loaded = tensors["--stream"], tensors["--no-stream"]
    assert streamed.keys() == loaded.keys()
    different = [k for k in loaded if not torch.allclose(streamed[k].float(), loaded[k].float(), atol=1e-5, rtol=1e-4)]
    assert not different, different
