"""`attnsurg analyze`: the numerical lens on a model's attention (spectra, RoPE energy, sparsity), measured on
the model's own Q, K, V over real text, written as plots and a JSON report."""

from attnsurg.analyze.run import run_analysis

__all__ = ["run_analysis"]
