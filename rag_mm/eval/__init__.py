"""Evaluation helpers: the VQA metric, the blind prior, prediction files, and reading run
directories (the notebooks')."""
